"""The core's conformance kit, run on this plugin as on any third party's.

The kit's own 2-rank loss-parity runs are left out (`parity = ()`): this
plugin's parity tests cover more parallelisms through the runtime already.
"""

from titan_plugins.testing import ConformanceSuite


class TestLlama4Conformance(ConformanceSuite):
    model_name = "llama4"
    overrides = ["model.n_layers=2"]
    parity = ()


def test_pipeline_split_with_documents_passes_stage_inputs():
    """The kit's split check on the irope flavor with documents: the later stage
    needs the document ids, which the kit hands every stage as the trainer does."""
    from titan_plugins.testing.conformance import Target, check_pipeline_split

    overrides = ("model.flavor=debugmodel_irope", "model.n_layers=2", "model.eos_id=10",
                 "model.fixed_attn_block_size=4")
    assert check_pipeline_split(Target("llama4", overrides=overrides)) is None
