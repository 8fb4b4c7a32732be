"""The core's conformance kit, run on this plugin as on any third party's.

The kit's 2-rank loss-parity runs are left out (`parity = ()`): test_llama3_parallel.py
covers FSDP, TP, HSDP and pipeline stages in one 4-rank launch already."""

from titan_plugins.testing import ConformanceSuite


class TestLlama3Conformance(ConformanceSuite):
    model_name = "llama3"
    # small and GQA (debugmodel is MHA at dim 256): the contracts, not the sizes, are checked
    overrides = ["model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2"]
    parity = ()
