"""A GPT-2 style decoder as a titan-plugins model plugin (an example of a third-party
plugin). Light: importing this imports no torch."""

__version__ = "0.1.0"
