"""The checkpoint room: the run's DCP checkpointer (``checkpointer.py``: save, resume,
manifests, full state dicts for export). The adapter-only checkpoints of LoRA runs
live with PEFT (``titan_plugins.peft.checkpoint``), a Hugging Face folder's loading
with ``titan_plugins.hf.load``; all of them sit on this layer (docs/architecture.md)."""
