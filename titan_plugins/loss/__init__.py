"""The loss room: token cross-entropy over the global batch (``token_loss.py``) and its
fused, chunked form that never holds the whole logits (``fused.py``)."""
