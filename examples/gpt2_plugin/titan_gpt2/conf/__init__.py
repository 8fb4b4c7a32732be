"""Hydra config groups contributed by titan-gpt2-example (``pkg://titan_gpt2.conf``)."""
