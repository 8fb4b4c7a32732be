"""Llama 4 from and to a Hugging Face folder (``model.hf``, ``titan-export``): config.json
mapping, strict weight load through the adapter, logits equal to transformers' in fp32
(eager attention) with HF's NoPE placement, qk L2-norm, attention temperature, chunked
attention, llama3 RoPE scaling and interleaved MoE layers all on.

The folders are tiny random models built by transformers from a config and written
with ``save_pretrained`` (nothing is downloaded)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from titan_llama4.config import FLAVORS  # noqa: E402
from titan_llama4.hf_config import config_from_hf, config_to_hf  # noqa: E402
from titan_llama4.model import build  # noqa: E402

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf.export import export_folder  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.testing.model_parts import hf_model  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

VOCAB = 96
TEXT = dict(  # 4 layers: dense, MoE, dense, MoE + NoPE (HF's default placement: (i + 1) % 4 == 0)
    vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
    interleave_moe_layer_step=2, attention_chunk_size=5, use_qk_norm=True, attn_temperature_tuning=True,
    floor_scale=3, attn_scale=0.5, eos_token_id=5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
)
SYNTH = ["data.name=synthetic", f"data.vocab_size={VOCAB}", "training.seq_len=16"]
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_folder(tmp_path, multimodal: bool = False, **extra):
    """A saved random model: Llama4ForCausalLM, or the multimodal Llama4ForConditionalGeneration."""
    torch.manual_seed(0)
    text = transformers.Llama4TextConfig(**{**TEXT, **extra})
    if multimodal:
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                      projector_output_dim=16, rope_theta=10000)
        model = transformers.Llama4ForConditionalGeneration(
            transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision))
    else:
        model = transformers.Llama4ForCausalLM(text)
    model.config._attn_implementation = "eager"
    model.eval()
    with torch.no_grad():  # random (not HF's near-zero init) so every weight matters
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = tmp_path / ("multimodal" if multimodal else "text")
    model.save_pretrained(folder)
    return folder, model


def load_ours(folder, *overrides):
    return hf_model("llama4", folder, *SYNTH, *overrides)


def logits_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("multimodal", [False, True], ids=["causal_lm", "conditional_generation"])
def test_logits_equal_transformers_and_export_loads_strictly(tmp_path, multimodal):
    folder, ref = hf_folder(tmp_path, multimodal)
    job, cfg, ours, counts = load_ours(folder)
    assert cfg.nope_layers == [3] and cfg.qk_norm and cfg.attn_temperature_tuning and cfg.floor_scale == 3
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (cfg.ffn_hidden_dim, cfg.moe_hidden_dim, cfg.kv_heads, cfg.fixed_attn_block_size) == (48, 24, 2, 5)
    assert counts["kept"] == 0 and counts["loaded"] == len(ours.state_dict())  # expert_bias: from_hf's zeros
    # each entry read as slices only, also w1/w3 out of the transposed, fused gate_up_proj: the
    # declared mapping (Fuse + Transpose) says where they are, not a probe of to_hf
    assert counts["sliced"] == counts["loaded"], counts
    text_model = ref.language_model if multimodal else ref  # (transformers 5.24's multimodal forward
    with torch.no_grad():                                  # fails on text alone; its text model is this)
        want = text_model(TOKENS).logits
        got = ours(TOKENS)
    assert logits_diff(got, want) <= 1e-5
    # each setting matters: without it the logits move (the comparison above can fail)
    for change in () if multimodal else ({"qk_norm": False}, {"attn_temperature_tuning": False},
                                         {"nope_layers": []}):
        other = build(replace(cfg, **change))
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert logits_diff(other.eval()(TOKENS), want) > 1e-3, change

    spec = get_plugin_manager().get_model("llama4")
    out = export_folder(spec, cfg, job, ours.state_dict(), tmp_path / "exported")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert type(again) is transformers.Llama4ForCausalLM and not any(info.values()), info
    with torch.no_grad():
        assert logits_diff(again.eval()(TOKENS).logits, got) <= 1e-5


def test_config_round_trip_loads_in_transformers():
    """Every flavor's config.json loads in transformers and maps back to the flavor's values."""
    from omegaconf import OmegaConf

    for name, flavor in FLAVORS.items():
        hf = transformers.AutoConfig.for_model(**config_to_hf(flavor)).to_dict()
        values = config_from_hf(hf)
        back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(flavor), values))
        assert config_to_hf(back) == config_to_hf(flavor), name
        for key in ("ffn_hidden_dim", "moe_hidden_dim", "head_dim"):
            assert getattr(back, key) == getattr(flavor, key), (name, key)
        assert [back.uses_rope(i) for i in range(flavor.n_layers)] == [
            flavor.uses_rope(i) for i in range(flavor.n_layers)], name
    # a multimodal config.json reads its text_config
    multimodal = transformers.Llama4Config(text_config=TEXT).to_dict()
    assert config_from_hf(multimodal) == config_from_hf(transformers.Llama4TextConfig(**TEXT).to_dict())


def test_published_scout_config_maps():
    """Llama-4-Scout-17B-16E's config.json (transformers 4.51 format, vision part cut):
    TorchTitan's 17bx16e sizes, HF's NoPE placement, qk-norm, temperature, its RoPE scaling."""
    text = dict(
        attention_bias=False, attention_chunk_size=8192, attention_dropout=0.0, attn_scale=0.1,
        attn_temperature_tuning=4, bos_token_id=200000, eos_token_id=[200001, 200007, 200008], floor_scale=8192,
        for_llm_compressor=False, head_dim=128, hidden_act="silu", hidden_size=5120, initializer_range=0.02,
        interleave_moe_layer_step=1, intermediate_size=8192, intermediate_size_mlp=16384,
        max_position_embeddings=262144, model_type="llama4_text", moe_layers=list(range(48)),
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)], num_attention_heads=40, num_experts_per_tok=1,
        num_hidden_layers=48, num_key_value_heads=8, num_local_experts=16, output_router_logits=False,
        pad_token_id=200018, rms_norm_eps=1e-05, rope_theta=500000.0, router_aux_loss_coef=0.001,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        router_jitter_noise=0.0, torch_dtype="bfloat16", use_cache=True, use_qk_norm=True, vocab_size=202048,
    )
    values = config_from_hf({"architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080,
                             "eoi_token_index": 200081, "image_token_index": 200092, "model_type": "llama4",
                             "text_config": text, "tie_word_embeddings": False, "transformers_version": "4.51.0",
                             "vision_config": {"hidden_size": 1408}})
    from omegaconf import OmegaConf

    scout = FLAVORS["17bx16e"]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(scout), values))
    for key in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim", "moe_hidden_dim"):
        assert getattr(cfg, key) == getattr(scout, key), key
    assert cfg.hidden_dim is None and all(cfg.is_moe_layer(i) for i in range(48))
    assert cfg.nope_layers == list(range(3, 48, 4)) and cfg.fixed_attn_block_size == 8192
    assert cfg.qk_norm and cfg.attn_temperature_tuning and cfg.eos_id == 200001
    assert (cfg.rope_scaling.scaling_factor, cfg.rope_scaling.high_freq_factor) == (8.0, 4.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_act", "gelu"), ("attention_bias", True), ("tie_word_embeddings", True),
     ("quantization_config", {}), ("head_dim", 32), ("layer_types", ["chunked_attention"] * 6),
     ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     ("num_hidden_layers", 2.5)],  # was silently truncated to 2 before the shared HFConfigMap
)
def test_unhonourable_field_is_one_error(tmp_path, field, value):
    folder = tmp_path / "edited"
    folder.mkdir()
    data = config_to_hf(FLAVORS["debugmodel"])
    (folder / "model.safetensors").write_bytes(b"")  # never read: config.json fails first
    data[field] = value
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        prepare_job(["model=llama4", f"model.hf={folder}", *SYNTH], get_plugin_manager())
    msg = str(err.value)
    assert "\n" not in msg and f"config.json: {field}" in msg and "model.hf=" in msg, msg


def test_export_refuses_routing_without_hf_equivalent():
    from titan_plugins.components.moe.config import ScoreFunc

    flavor = FLAVORS["debugmodel"]
    with pytest.raises(ConfigError, match="model.moe.score_func='softmax'"):
        config_to_hf(replace(flavor, moe=replace(flavor.moe, score_func=ScoreFunc.softmax)))


def test_cached_decoding_equals_full_forward_with_hf_settings():
    """Temperature (by absolute position), qk-norm and chunks under the KV cache: a prompt
    then one token at a time gives the full forward's logits."""
    from titan_plugins.generate import KVCache

    values = config_from_hf(transformers.Llama4TextConfig(**TEXT).to_dict())
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["debugmodel"]), values))
    torch.manual_seed(0)
    model = build(cfg)
    with torch.no_grad():
        model.init_weights()
        want = model.eval()(TOKENS)
        cache, got = KVCache(), []
        for start, end in [(0, 7)] + [(i, i + 1) for i in range(7, TOKENS.shape[1])]:
            got.append(model(TOKENS[:, start:end], cache=cache))
            cache.advance(end - start)
    assert logits_diff(torch.cat(got, dim=1), want) <= 1e-5


@pytest.mark.slow
def test_sharded_load_matches_one_rank_load(tmp_path):
    """2 ranks: FSDP x EP (each rank holds half the experts) and TP (qk-norm and the
    temperature on local heads), each loaded from the folder and equal to one rank."""
    import llama4_hf_worker

    from titan_plugins.testing.gloo import run_ranks

    folder, _ = hf_folder(tmp_path)
    layouts = {"fsdp2_ep2": {"dp_shard": 2, "ep": 2}, "tp2": {"tp": 2}}
    results = run_ranks(llama4_hf_worker.main, 2, str(folder), list(layouts.values()))[0]
    for name, result in zip(layouts, results, strict=True):
        assert result["sharded_entries"] > 0 and result["sliced"] > 0, (name, result)  # real shards, sliced reads
        assert result["kept"] == 0, (name, result)
        assert result["max_logits_diff"] <= 1e-5, (name, result)


@pytest.mark.slow  # a one-rank training run in a subprocess (about 25-40 s)
def test_export_is_the_trained_model(tmp_path):
    """Issue 26: 3 steps from a Llama 4 folder (MoE every other layer, NoPE, chunked
    attention), both export routes; transformers on the export gives the trained model's
    loss and greedy generation. The folder's max_position_embeddings (131072, not the
    flavor's 2048), its three EOS ids and BOS/PAD come back; no router bias trains
    (Llama 4 has none); generation_config.json is written when the folder had none."""
    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER
    from titan_plugins.testing.hf_check import check_export_is_trained_model

    folder, _ = hf_folder(tmp_path, vocab_size=2048, max_position_embeddings=131072)
    (folder / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())
    (folder / "generation_config.json").unlink()
    source = json.loads((folder / "config.json").read_text())
    source.update(bos_token_id=2046, eos_token_id=[2047, 5, 7], pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(source))
    got = check_export_is_trained_model(
        "llama4", folder, tmp_path, ["data.name=synthetic", "data.vocab_size=2048", "training.seq_len=16"])
    config = got["config"]
    assert config["max_position_embeddings"] == 131072 and config["eos_token_id"] == [2047, 5, 7]
    tok_config = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|bos|>", "<|eos|>")
    print(got["loss_diff"], got["logits_diff"], got["moved"])


def test_moe_from_folder_trains_no_router_bias(tmp_path):
    from titan_llama4.state_dict_adapter import Llama4StateDictAdapter

    folder, _ = hf_folder(tmp_path)
    _, cfg, ours, _ = load_ours(folder)
    assert cfg.moe.load_balance_coeff is None and not any("expert_bias" in k for k in ours.state_dict())
    _, cfg, ours, _ = load_ours(folder, "model.moe.load_balance_coeff=0.001")
    sd = ours.state_dict()
    sd["layers.1.moe.expert_bias"] = torch.full_like(sd["layers.1.moe.expert_bias"], 0.01)
    with pytest.raises(ConfigError, match="router bias .* Llama4ForCausalLM"):
        Llama4StateDictAdapter(cfg).to_hf(sd)
