"""model=hf beyond the tested families (issue 46): structure from the model's
declarations, checkpoint layouts through transformers' own conversions, the work a
forward does around its layers, strict loading and ``model.verify``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from titan_hf.verify import verify  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf import load_hf_model  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
SYNTH = ["data=synthetic", "data.vocab_size=256"]


def _folder(tmp_path, model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **{**TINY, **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if p.dim() == 1 and "norm" in name else 0.0, 0.2)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    return folder


def _losses(folder, *overrides):
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_hf_model("hf", folder, overrides=[*SYNTH, *overrides]).eval()
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))

    def loss(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    return loss(ours(ids)), loss(ref(ids).logits)


def test_per_expert_moe_folder_loads_every_expert(tmp_path):
    """Qwen2-MoE stores one tensor per expert and transformers fuses them in memory:
    the load converts through transformers' own mapping (before, the experts stayed random)."""
    folder = _folder(tmp_path, "qwen2_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     shared_expert_intermediate_size=32)
    keys = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys  # the per-expert layout on disk
    ours, theirs = _losses(folder)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)


def test_export_layout_is_the_folders(tmp_path):
    """to_hf gives save_pretrained's names and shapes (per expert), from_hf inverts it."""
    from titan_hf.config import HFModelConfig, config_from_hf
    from titan_hf.state_dict_adapter import HFStateDictAdapter

    folder = _folder(tmp_path, "olmoe", num_experts=4, num_experts_per_tok=2)
    on_disk = load_file(folder / "model.safetensors")
    config = HFModelConfig(**config_from_hf(json.loads((folder / "config.json").read_text())))
    adapter = HFStateDictAdapter(config)
    ours = adapter.from_hf(on_disk)
    assert "layers.0.mlp.experts.gate_up_proj" in ours  # fused in memory
    back = adapter.to_hf(ours)
    assert set(back) == set(on_disk)
    for key, value in on_disk.items():
        assert torch.equal(back[key], value), key


def test_logit_scale_after_the_head_is_applied(tmp_path):
    """Cohere multiplies its logits by logit_scale after the head: applied, whole-logits loss."""
    folder = _folder(tmp_path, "cohere", logit_scale=0.25)
    ours, theirs = _losses(folder)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    model = load_hf_model("hf", folder, overrides=SYNTH)
    assert model.titan_fused_loss is False and model.post_head is not None


def test_embedding_multiplier_before_the_layers_is_applied(tmp_path):
    """Granite scales its embeddings in the base model's forward and divides its logits."""
    folder = _folder(tmp_path, "granite", embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22)
    ours, theirs = _losses(folder)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)


def test_a_plain_head_keeps_the_fused_loss(tmp_path):
    model = load_hf_model("hf", _folder(tmp_path, "qwen2"), overrides=SYNTH)
    assert model.titan_fused_loss is True and model.post_head is None and model.embed_work is None


def test_post_head_statements_reading_other_names_are_refused():
    from titan_hf.head import post_head

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(2, 2)

        def forward(self, hidden_states, temperature):
            logits = self.lm_head(hidden_states)
            logits = logits / temperature
            return logits

    with pytest.raises(ConfigError, match="using temperature"):
        post_head(Odd(), "lm_head")


def test_learned_positions_are_refused_in_one_line(tmp_path):
    """GPT-2's base holds weights (wpe) outside embeddings, layers and norm."""
    folder = _folder(tmp_path, "gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    with pytest.raises(ConfigError) as info:
        load_hf_model("hf", folder, overrides=SYNTH)
    assert "\n" not in str(info.value) and "wpe" in str(info.value)


def test_a_parameter_missing_from_the_folder_stops_the_load(tmp_path):
    folder = _folder(tmp_path, "qwen2")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        load_hf_model("hf", folder, overrides=SYNTH)
    text = str(info.value)
    assert "\n" not in text and "layers.1.mlp.up_proj.weight" in text and "hf_partial" in text
    load_hf_model("hf", folder, overrides=[*SYNTH, "model.hf_partial=true"])  # the explicit opt-out


def test_a_tied_head_is_said_as_tied(tmp_path, capsys):
    from titan_plugins.hf.load import load_hf_weights

    folder = _folder(tmp_path, "qwen2", tie_word_embeddings=True)
    model = load_hf_model("hf", folder, overrides=SYNTH)
    spec = get_plugin_manager().get_model("hf")
    load_hf_weights([model], spec, model.config, folder, verbose=True)
    out = capsys.readouterr().out
    assert "output.weight (tied to tok_embeddings.weight)" in out and "kept at their initial" not in out


def _spec_and_config(folder):
    from titan_hf.config import HFModelConfig, config_from_hf

    config = HFModelConfig(**config_from_hf(json.loads((folder / "config.json").read_text())))
    return get_plugin_manager().get_model("hf"), config


def test_verify_passes_an_equal_model_and_says_so(tmp_path):
    folder = _folder(tmp_path, "granite", embedding_multiplier=12.0, num_hidden_layers=3)
    spec, config = _spec_and_config(folder)
    ids = torch.randint(3, 256, (1, 33), generator=torch.Generator().manual_seed(2))
    line = verify(spec, config, str(folder), ids[:, :-1], ids[:, 1:], forced=False)
    assert line is not None and "first 2 of 3 layers" in line and "difference 0.0e+00" in line


def test_verify_passes_an_equal_model_on_packed_documents(tmp_path):
    """With ``model.attn_mask=block_causal`` transformers gets the per-document positions
    and no cache (its packed path; a cache turns it off): it stopped such runs before."""
    import dataclasses

    from titan_plugins.components.attention_masks import AttentionMask

    folder = _folder(tmp_path, "granite", embedding_multiplier=12.0)
    spec, config = _spec_and_config(folder)
    config = dataclasses.replace(config, attn_mask=AttentionMask.block_causal)
    ids = torch.randint(0, 8, (1, 33), generator=torch.Generator().manual_seed(2))  # EOS id 2: ~4 documents
    assert (ids[0, :-1] == 2).sum() >= 2
    line = verify(spec, config, str(folder), ids[:, :-1], ids[:, 1:], forced=True)
    assert line is not None and "difference 0.0e+00" in line, line


def test_verify_passes_a_model_that_samples_in_training(tmp_path):
    """PhiMoE samples its experts in training (transformers' default router_jitter_noise
    0.01): both sides draw the same numbers, so an equal model is not stopped by luck."""
    folder = _folder(tmp_path, "phimoe", num_local_experts=4)
    spec, config = _spec_and_config(folder)
    assert json.loads((folder / "config.json").read_text())["router_jitter_noise"] == 0.01
    ids = torch.randint(3, 256, (1, 129), generator=torch.Generator().manual_seed(0))  # verify's 128 tokens
    line = verify(spec, config, str(folder), ids[:, :-1], ids[:, 1:], forced=True)
    assert line is not None and "difference 0.0e+00" in line, line


def test_verify_names_the_worst_tensor_of_a_wrong_model(tmp_path, monkeypatch):
    """Without the base forward's embedding work the model is wrong: one line, before launch."""
    import titan_hf.model

    folder = _folder(tmp_path, "granite", embedding_multiplier=12.0)
    monkeypatch.setattr(titan_hf.model, "embed_work", lambda base: None)
    spec, config = _spec_and_config(folder)
    ids = torch.randint(3, 256, (1, 33), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ConfigError) as info:
        verify(spec, config, str(folder), ids[:, :-1], ids[:, 1:], forced=True)
    text = str(info.value)
    assert "\n" not in text and "differs from transformers" in text and "worst gradient layers." in text


def test_verify_left_at_auto_skips_a_tested_family(tmp_path):
    from titan_hf.testing import save_folder

    folder = save_folder("tiny_llama", tmp_path / "llama")
    spec, config = _spec_and_config(folder)
    ids = torch.randint(3, 256, (1, 9))
    assert verify(spec, config, str(folder), ids[:, :-1], ids[:, 1:], forced=False) is None


def test_verify_line_reaches_the_prepared_job(tmp_path):
    from titan_plugins.train.api import prepare_job

    folder = _folder(tmp_path, "cohere", logit_scale=0.25)
    _, job, _ = prepare_job(["model=hf", f"model.hf={folder}", *SYNTH, "training.seq_len=32"], get_plugin_manager())
    assert job.model.verified.startswith("against transformers") and "32 synthetic tokens" in job.model.verified
    _, job, _ = prepare_job(["model=hf", f"model.hf={folder}", *SYNTH, "training.seq_len=32", "model.verify=false"],
                            get_plugin_manager())
    assert job.model.verified is None


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_packed_rows_equal_transformers_packed_path(tmp_path, model_type):
    """Issue 46.7: documents packed in a row attend only to themselves, through
    transformers' own packed-sequence path (per-document position_ids); step-1 loss
    equal to transformers' on the same packed row, and not equal to the unmasked row."""
    from titan_hf.model import document_positions

    from titan_plugins.components.attention_masks import documents

    folder = _folder(tmp_path, model_type, sliding_window=8)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_hf_model("hf", folder, overrides=[*SYNTH, "model.attn_mask=block_causal"]).eval()
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 15 + [1] * 9])
    positions = document_positions(doc_ids)
    assert positions[0, 7].item() == 0 and positions[0, 16].item() == 9 and positions[1, 15].item() == 0

    def loss(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    with documents(doc_ids) as docs:
        got = loss(ours(ids))
    assert docs.used
    want = loss(ref(ids, position_ids=positions, use_cache=False).logits)  # packed path: no cache
    assert abs(got - want) <= 1e-5, (got, want)
    assert abs(loss(ref(ids).logits) - want) > 1e-3  # the masks made a difference


def test_block_causal_under_pp_is_refused_in_one_line(tmp_path):
    from titan_plugins.train.api import prepare_job

    folder = _folder(tmp_path, "qwen2")
    with pytest.raises(ConfigError, match="block_causal with parallelism.pp=2"):
        prepare_job(["model=hf", f"model.hf={folder}", *SYNTH, "model.attn_mask=block_causal",
                     "parallelism.pp=2", "parallelism.world_size=2", "model.verify=false"], get_plugin_manager())
