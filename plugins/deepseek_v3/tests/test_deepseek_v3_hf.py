"""DeepSeek-V3 from and to Hugging Face folders: config.json mapping, strict weight
load through ``model.hf``, logits equal to transformers' ``DeepseekV3ForCausalLM`` in
fp32 (eager attention), and an exported folder transformers loads strictly.

The folders are tiny random models built by transformers from a config and written
with ``save_pretrained`` (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from titan_deepseek_v3.config import FLAVORS  # noqa: E402
from titan_deepseek_v3.hf_config import config_from_hf, config_to_hf  # noqa: E402

from titan_plugins.config.hydra_glue import model_config  # noqa: E402
from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.hf.export import export_folder  # noqa: E402
from titan_plugins.hf.load import load_hf_weights  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

# Two layers (one dense, one MoE), 8 experts in 2 groups (one kept), q_lora, YaRN whose
# mscale != mscale_all_dim (so cos/sin carry an attention_factor), rms_norm_eps != 1e-6.
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=1.0),
)
SYNTH = ["data.name=synthetic", "data.vocab_size=96", "training.seq_len=16"]  # the folder's tokenizer is a stub


def hf_folder(path, **extra):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY, **extra}))
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random (not HF's near-zero init) so every weight and the routing bias matter
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")  # only its presence matters here
    return model.eval()


def load_ours(folder):
    pm = get_plugin_manager()
    spec, job, _ = prepare_job(["model=deepseek_v3", f"model.hf={folder}", *SYNTH], pm)
    cfg = model_config(job.model, spec)
    model = spec.load("build")(cfg)
    with torch.no_grad():
        model.init_weights()
    counts = load_hf_weights([model], spec, cfg, folder)
    return spec, job, cfg, model.eval(), counts


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_logits_equal_transformers_and_export_loads_strictly(tmp_path, q_lora_rank):
    ref = hf_folder(tmp_path / "hf", q_lora_rank=q_lora_rank)
    spec, job, cfg, ours, counts = load_ours(tmp_path / "hf")
    assert counts["kept"] == 0, counts  # every entry came from the folder (expert_bias included)
    moe = cfg.layer.moe
    assert (moe.num_expert_groups, moe.num_limited_groups, moe.route_scale, moe.route_norm) == (2, 1, 2.5, True)
    assert cfg.layer.attention.q_lora_rank == (q_lora_rank or 0) and cfg.yarn_enabled
    assert (cfg.layer.norm.latent, cfg.layer.norm.final_eps) == (1e-6, 1e-5)
    assert ours.layers["1"].moe.expert_bias.abs().sum() > 0
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = ours(tokens)
    assert (got - want).abs().max().item() <= 1e-5

    out = export_folder(spec, cfg, job, ours.state_dict(), tmp_path / "exported")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert type(again) is type(ref) and not any(info.values()), info  # strict: nothing missing or unexpected
    with torch.no_grad():
        assert (again.eval()(tokens).logits - got).abs().max().item() <= 1e-5


# The published DeepSeek-V3 config.json (remote-code names), without its fp8 quantization_config.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def _merged(values):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FLAVORS["671B"]), values))


def test_published_config_maps_to_the_671b_shapes_and_back():
    cfg = _merged(config_from_hf(DEEPSEEK_V3))
    flavor = FLAVORS["671B"]
    for key in ("vocab_size", "dim", "n_layers", "n_dense_layers"):
        assert getattr(cfg, key) == getattr(flavor, key), key
    assert cfg.layer.attention == flavor.layer.attention and cfg.layer.ffn == flavor.layer.ffn
    assert cfg.layer.moe == flavor.layer.moe
    assert cfg.yarn_enabled and cfg.layer.rope.attention_factor == 1.0 and cfg.layer.rope.mscale == 1.0
    back = config_to_hf(cfg)
    again = transformers.AutoConfig.for_model(**back).to_dict()  # transformers reads what we write
    assert config_from_hf(again) == config_from_hf(back)
    # absent fields mean transformers' defaults, not the flavor's
    assert config_from_hf({"model_type": "deepseek_v3"}) == config_from_hf(transformers.DeepseekV3Config().to_dict())
    with pytest.raises(ConfigError, match="quantization_config"):
        config_from_hf({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match="score_func='softmax'"):
        config_to_hf(FLAVORS["debugmodel"])  # TorchTitan's debug routing has no config.json form


BAD_FIELDS = [("hidden_act", "gelu"), ("scoring_func", "softmax"), ("rope_interleave", False),
              ("tie_word_embeddings", True), ("num_key_value_heads", 2), ("some_new_field", 1)]


def test_unhonourable_fields_fail_in_one_line(tmp_path, capsys):
    from titan_plugins.cli.run import main

    folder = tmp_path / "hf"
    hf_folder(folder)
    good = json.loads((folder / "config.json").read_text())
    pm = get_plugin_manager()
    for field, value in BAD_FIELDS:
        (folder / "config.json").write_text(json.dumps({**good, field: value}))
        with pytest.raises(ConfigError) as err:
            prepare_job(["model=deepseek_v3", f"model.hf={folder}", *SYNTH], pm)
        msg = str(err.value)
        assert "\n" not in msg and f"config.json: {field}=" in msg and "model.hf=" in msg, msg
    rope = {**good["rope_parameters"], "truncate": False}
    (folder / "config.json").write_text(json.dumps({**good, "rope_parameters": rope}))
    capsys.readouterr()  # save_pretrained's progress output
    assert main(["model=deepseek_v3", f"model.hf={folder}", *SYNTH]) == 2  # before any rank starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json: rope_parameters.truncate=False" in err, err


SHARDED = [{"dp_shard": 2, "ep": 2}, {"tp": 2}]  # 2 ranks: FSDP x EP (each rank its 4 experts), TP


@pytest.mark.slow
def test_sharded_load_matches_one_rank_load(workdir):
    import deepseek_v3_hf_worker

    from titan_plugins.testing.gloo import run_ranks

    hf_folder(workdir / "hf")
    results = run_ranks(deepseek_v3_hf_worker.main, 2, str(workdir / "hf"), SHARDED)[0]
    for par, result in zip(SHARDED, results, strict=True):
        assert result["read_whole"] == 0 and result["kept"] == 0, (par, result)  # only the rank's slices
        assert result["max_logits_diff"] <= 1e-5, (par, result)
    assert results[0]["local_experts"] == 4  # EP: half of the 8 experts on each rank


@pytest.mark.slow  # a one-rank training run in a subprocess (about 25-40 s)
def test_export_is_the_trained_model(tmp_path):
    """Issue 26: 3 steps from a DeepSeek-V3 folder (grouped sigmoid routing, a trained
    e_score_correction_bias, YaRN), both export routes; transformers on the export gives
    the trained model's loss and greedy generation. The trained router bias is exported;
    max_position_embeddings is the folder's (64), not training.seq_len (16)."""
    from safetensors.torch import load_file

    from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER
    from titan_plugins.testing.hf_check import check_export_is_trained_model

    folder = tmp_path / "hf"
    hf_folder(folder, vocab_size=2048)
    (folder / "tokenizer.json").write_bytes(DEFAULT_TOKENIZER.read_bytes())
    got = check_export_is_trained_model(
        "deepseek_v3", folder, tmp_path, ["data.name=synthetic", "data.vocab_size=2048", "training.seq_len=16"])
    assert got["config"]["max_position_embeddings"] == 64
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    start = load_file(str(folder / "model.safetensors"))[key]
    exported = load_file(str(next((tmp_path / "exported").glob("*.safetensors"))))[key]
    assert not torch.equal(start, exported)  # the bias trained (load balancing) and was exported
    print(got["loss_diff"], got["logits_diff"], got["moved"])


def test_yaml_seq_len_default_yields_to_the_folder(tmp_path):
    """The model YAML's ``max_seq_len: ${training.seq_len}`` is a default: config.json's
    max_position_embeddings wins over it, an explicit override wins over both."""
    from titan_plugins.config.hydra_glue import model_config
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    hf_folder(tmp_path / "hf")
    pm = get_plugin_manager()
    for extra, want in (([], 64), (["model.max_seq_len=32"], 32)):
        spec, job, _ = prepare_job(["model=deepseek_v3", f"model.hf={tmp_path / 'hf'}", *SYNTH, *extra], pm)
        assert model_config(job.model, spec).max_seq_len == want, extra
    spec, job, _ = prepare_job(["model=deepseek_v3", *SYNTH], pm)  # no folder: TorchTitan's rule
    assert model_config(job.model, spec).max_seq_len == 16
