"""Hydra config tree of the Qwen3 plugin (``pkg://titan_qwen3.conf``)."""
