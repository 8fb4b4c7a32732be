"""Llama 3 for titan-plugins (light: importing this package imports no torch)."""

__version__ = "0.1.0"
