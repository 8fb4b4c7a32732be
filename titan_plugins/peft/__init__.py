"""Parameter-efficient fine-tuning: model transforms between a plugin's ``build`` and
its ``parallelize`` hook, for any plugin's model (LoRA first).

    config.py      the ``peft`` config group's schema (no torch: imported by Hydra)
    targets.py     which ``nn.Linear`` modules the ``target_modules`` patterns name
    lora.py        ``LoRALinear``, the transform, adapter init and merge
    experts.py     LoRA on grouped MoE experts (per-expert pairs as grouped tensors)
    checkpoint.py  adapter-only checkpoint state and PEFT adapters in (``peft.init_from``)
    export.py      PEFT adapter folders and merged Hugging Face folders out
"""
