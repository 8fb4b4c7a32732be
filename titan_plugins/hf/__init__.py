"""Hugging Face model folders in and out: config.json through the plugin's
``config_from_hf`` / ``config_to_hf``, weights through its state-dict adapter.

- :mod:`titan_plugins.hf.config`: read and check a folder before launch.
- :mod:`titan_plugins.hf.load`: sharded load, each rank reading only its slices.
- :mod:`titan_plugins.hf.export`: a DCP checkpoint or a live model to a folder.
"""
