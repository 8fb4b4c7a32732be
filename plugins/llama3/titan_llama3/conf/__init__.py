"""Hydra config tree of the Llama 3 plugin (``pkg://titan_llama3.conf``)."""
