"""The model room: a chosen ModelSpec made into this rank's trainable parts
(``lifecycle.py``: build on meta, PEFT, pipeline split, parallelize, materialize, init)
and their optimizer (``optimizer.py``). No model is named here; plugins bring them."""
