"""The core's conformance kit, run on this plugin as on any third party's.

Of the kit's 2-rank loss-parity runs only EP runs here (on the MoE flavor): this
plugin's own parity tests cover FSDP and TP through the runtime already.
"""

from titan_plugins.testing import ConformanceSuite


class TestQwen3Conformance(ConformanceSuite):
    model_name = "qwen3"
    overrides = ["model.n_layers=2"]
    ep_overrides = ["model.flavor=debugmodel_moe", "model.n_layers=2"]
    pp_overrides = ["model.enable_weight_tying=false"]
    parity = ("ep",)
