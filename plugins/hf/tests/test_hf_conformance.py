"""The core's conformance kit, run on model=hf as on any third party's plugin (on the
tiny Llama flavor; the multi-rank parity runs are test_hf_parallel's, on a folder)."""

from titan_plugins.testing import ConformanceSuite


class TestHFConformance(ConformanceSuite):
    model_name = "hf"
    overrides = ["model.flavor=tiny_llama"]
    parity = ()
