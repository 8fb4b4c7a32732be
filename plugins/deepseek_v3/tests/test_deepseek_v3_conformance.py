"""The core's conformance kit, run on this plugin as on any third party's.

The kit's own 2-rank loss-parity runs are left out (`parity = ()`): this
plugin's parity tests cover more parallelisms through the runtime already.

The Hugging Face round trip runs on the settings ``DeepseekV3ForCausalLM`` can
express (sigmoid routing, its norm eps, YaRN on): the debug flavor keeps
TorchTitan's softmax routing, which config.json cannot say (``config_to_hf``
refuses it with a ConfigError).
"""

import dataclasses

from titan_plugins.testing import ConformanceSuite
from titan_plugins.testing.suite import _run

HF_OVERRIDES = (
    "model.layer.moe.score_func=sigmoid", "model.layer.moe.route_norm=true", "model.layer.moe.route_scale=2.5",
    "model.layer.moe.num_expert_groups=4", "model.layer.moe.num_limited_groups=2",
    "model.layer.norm.latent_eps=1e-6", "model.layer.norm.final_eps=1e-5", "model.layer.rope.scaling=yarn",
)


class TestDeepSeekV3Conformance(ConformanceSuite):
    model_name = "deepseek_v3"
    overrides = ["model.n_layers=2"]
    parity = ()

    def test_hf_round_trip(self) -> None:
        from titan_plugins.testing.hf_check import check_hf_round_trip

        target = self.titan_target()
        _run(check_hf_round_trip, dataclasses.replace(target, overrides=(*target.overrides, *HF_OVERRIDES)))
