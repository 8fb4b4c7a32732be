"""The core's conformance kit, run on this plugin as on any third party's.

Of the kit's 2-rank loss-parity runs only `cp` runs (the kit's context-parallel check
on the dense reference, as a third party's plugin would meet it): test_llama3_parallel.py
covers FSDP, TP, HSDP and pipeline stages in one 4-rank launch already."""

from titan_plugins.testing import ConformanceSuite


class TestLlama3Conformance(ConformanceSuite):
    model_name = "llama3"
    # small and GQA (debugmodel is MHA at dim 256): the contracts, not the sizes, are checked
    overrides = ["model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2"]
    parity = ("cp",)
