"""titan-hf: any Hugging Face causal LM as a titan-plugins model (``model=hf model.hf=DIR``)."""
