"""The core's conformance kit, run on this plugin as on any third party's.

The kit's own 2-rank loss-parity runs are left out (`parity = ()`): this
plugin's parity tests cover more parallelisms through the runtime already.
"""

from titan_plugins.testing import ConformanceSuite


class TestQwen3Conformance(ConformanceSuite):
    model_name = "qwen3"
    overrides = ["model.n_layers=2"]
    ep_overrides = ["model.flavor=debugmodel_moe", "model.n_layers=2"]
    pp_overrides = ["model.enable_weight_tying=false"]
    parity = ()
