"""The export room: every Hugging Face folder the project writes.

- ``out_dir``: may an export write (or replace) a folder? The marker and overwrite
  rules, in one place.
- ``hf_folder``: the one writer of a Hugging Face model folder (config.json, sharded
  safetensors, tokenizer and generation files), used by every kind below.
- ``source``: where an export reads from (a run directory's newest DCP checkpoint,
  its model weights in one process).
- ``full``: ``titan-export RUN`` and ``checkpoint.export_hf=true`` (the trained model).
- ``lora``: a LoRA run's ``merged`` folder and its ``peft-adapter`` folder.

Checkpoint loading (``checkpoint/checkpointer.py``, ``peft/checkpoint.py``) imports none of
this; the export imports what it reads through.
"""
