"""The core's conformance kit, run on model=hf as on any third party's plugin (on the
tiny Llama flavor, its EP checks on tiny Mixtral; the multi-rank parity runs are
test_hf_parallel's, on a folder)."""

from titan_plugins.testing import ConformanceSuite


class TestHFConformance(ConformanceSuite):
    model_name = "hf"
    overrides = ["model.flavor=tiny_llama"]
    ep_overrides = ["model.flavor=tiny_mixtral"]
    parity = ()
