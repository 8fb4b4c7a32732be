"""A metrics sink for titan-plugins: ``<run_dir>/metrics.csv``, one row per step."""

__version__ = "0.1.0"
