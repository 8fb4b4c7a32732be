"""``model=hf`` config: the node typed from config.json, and the one-line refusals
(unknown architecture, no folder, layouts a model cannot take), all before any rank."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from titan_hf.config import FLAVORS, config_from_hf, config_to_hf  # noqa: E402
from titan_hf.testing import save_folder  # noqa: E402

from titan_plugins.errors import ConfigError  # noqa: E402
from titan_plugins.plugins import get_plugin_manager  # noqa: E402
from titan_plugins.train.api import prepare_job  # noqa: E402

SYNTH = ["data=synthetic", "data.vocab_size=256", "training.seq_len=16"]


def _job(*overrides):
    return prepare_job(["model=hf", *SYNTH, *overrides], get_plugin_manager())


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder("tiny_mistral", tmp_path_factory.mktemp("hf_cfg") / "mistral")


def test_folder_types_the_node(folder):
    spec, job, _ = _job(f"model.hf={folder}")
    assert job.model.architecture == "MistralForCausalLM"
    assert (job.model.dim, job.model.n_layers, job.model.n_heads, job.model.n_kv_heads) == (64, 2, 4, 2)
    assert job.model.vocab_size == 256 and job.model.max_seq_len == 128
    assert job.model.hf_config["model_type"] == "mistral"
    assert "hidden_size" not in job.model.hf_config  # one source of truth: the typed field


def test_typed_override_on_top_of_the_folder(folder):
    _, job, _ = _job(f"model.hf={folder}", "model.n_layers=1", "model.hf_partial=true")
    assert job.model.n_layers == 1
    with pytest.raises(ConfigError) as info:
        _job(f"model.hf={folder}", "model.n_layers=one")
    assert "model.n_layers" in _one_line(info)


def test_no_folder_is_one_line():
    with pytest.raises(ConfigError) as info:
        _job()
    assert "model.hf is not set" in _one_line(info)


def test_missing_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        _job(f"model.hf={tmp_path / 'nope'}")
    assert "model.hf=" in _one_line(info) and "no such folder" in str(info.value)


@pytest.mark.parametrize("model_type, why", [
    ("not_a_model_type", "does not know it"),
    ("t5", "has no causal LM for it"),
    ("gemma3", "a wrapper (encoder-decoder or vision/audio)"),
])
def test_what_cannot_train_is_refused_in_one_line(tmp_path, folder, model_type, why):
    """No list of families gates model=hf (issue 46): a model_type the installed
    transformers cannot build as a decoder-only causal LM is one line naming it."""
    bad = tmp_path / model_type
    bad.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError) as info:
        _job(f"model.hf={bad}")
    text = _one_line(info)
    assert f"model_type={model_type!r}" in text and why in text


def test_the_class_follows_model_type_as_transformers_does(tmp_path, folder):
    """``architectures`` naming another class does not decide it (transformers' auto
    mapping goes by model_type); the export writes back what the folder said."""
    other = tmp_path / "qwen2"
    other.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    _, job, _ = _job(f"model.hf={other}")
    assert job.model.architecture == "LlamaForCausalLM" and job.model.hf_config.model_type == "qwen2"


@pytest.mark.parametrize("layout, match", [
    (["parallelism.ep=2", "parallelism.dp_shard=2", "parallelism.world_size=2", "model.flavor=tiny_llama"],
     "parallelism.ep=2: LlamaForCausalLM has no experts"),
    (["parallelism.ep=3", "parallelism.dp_shard=3", "parallelism.world_size=3", "model.flavor=tiny_mixtral"],
     "parallelism.ep=3: MixtralForCausalLM has 4 experts, not divisible by it"),
    (["parallelism=fsdp2_tp2_ep2_etp2", "model.flavor=tiny_qwen3_moe", "parallelism.sequence_parallel=false"],
     "parallelism.etp=2: model=hf shards whole experts"),
    (["parallelism.tp=2", "parallelism.world_size=2", "model.flavor=tiny_gpt_oss"], "declares no tensor-parallel plan"),
    # SP beside an MoE block the TP plan leaves out: before launch (it was each rank's error)
    (["parallelism=fsdp2_tp2", "model.flavor=tiny_mixtral"],
     "parallelism.sequence_parallel=true: MixtralForCausalLM's base_model_tp_plan leaves the layer's 'mlp'"),
    # ... also where the plan names a dense MLP's gate_proj that the MoE layer's mlp lacks
    # (it crashed inside the ranks: "aten.mm.default got mixed torch.Tensor and DTensor")
    (["parallelism=fsdp2_tp2", "model.flavor=tiny_qwen3_moe"],
     "parallelism.sequence_parallel=true: Qwen3MoeForCausalLM's base_model_tp_plan leaves the layer's 'mlp'"),
    (["parallelism.pp=2", "parallelism.world_size=2", "model.flavor=tiny_gemma3"], "enable_weight_tying=true"),
    (["parallelism.tp=4", "parallelism.world_size=4", "model.flavor=tiny_llama"], "model.n_kv_heads=2 is not divisible"),
    (["model.flavor=tiny_gpt_oss", "model.attn_implementation=sdpa"], "runs GptOssForCausalLM without SDPA"),
])
def test_layouts_a_model_cannot_take(layout, match):
    with pytest.raises(ConfigError) as info:
        _job(*layout)
    assert match in _one_line(info)


@pytest.mark.parametrize("name", [n for n in FLAVORS if n != "folder"])
def test_flavor_round_trips_through_config_json(name):
    flavor = FLAVORS[name]
    again = config_from_hf(config_to_hf(flavor))
    assert again["architecture"] == flavor.architecture
    assert again["hf_config"] == flavor.hf_config
    assert (again["dim"], again["n_layers"], again["enable_weight_tying"]) == \
        (flavor.dim, flavor.n_layers, flavor.enable_weight_tying)


def test_plan_at_64_ranks_in_one_process():
    """``plan=true`` on the fake process group: FSDP x TP (SP) x PP at 64 ranks."""
    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.train.api import typed_job

    pm = get_plugin_manager(strict=True)
    spec, job = resolve_job(compose(["model=hf", "model.flavor=tiny_mistral", *SYNTH, "parallelism.dp_shard=16",
                                     "parallelism.tp=2", "parallelism.pp=2", "plan=true"], pm), pm)
    plan = make_plan(spec, typed_job(job), pm)
    assert plan.world_size == 64 and plan.degrees["tp"] == 2 and plan.degrees["pp"] == 2
    assert len(plan.ranks) == 2 and all(r.memory.numel > 0 for r in plan.ranks)


def test_expert_parallel_plan_at_32_ranks_in_one_process():
    """``plan=true`` with transformers' expert-parallel plan on the fake process group:
    dp_shard 16 x tp 2 with ep 4 on Mixtral (experts 1 per EP rank)."""
    from titan_plugins.config.hydra_glue import compose, resolve_job
    from titan_plugins.plan import make_plan
    from titan_plugins.train.api import typed_job

    pm = get_plugin_manager(strict=True)
    spec, job = resolve_job(compose(["model=hf", "model.flavor=tiny_mixtral", *SYNTH, "parallelism.dp_shard=16",
                                     "parallelism.tp=2", "parallelism.ep=4", "parallelism.sequence_parallel=false",
                                     "plan=true"], pm), pm)
    plan = make_plan(spec, typed_job(job), pm)
    assert plan.world_size == 32 and plan.degrees["ep"] == 4
    assert all(r.memory.numel > 0 for r in plan.ranks)


def test_expert_parallel_plan_skips_dense_layers_and_refuses_a_missing_weight():
    """AFMoE's first layer is a dense MLP (transformers' ``first_k_dense``): its plan
    entries would name ``layers.0.mlp.experts.*``, which do not exist (a KeyError inside
    every rank before this); the experts of layer 1 are still sharded. A layer with experts
    but not a weight the plan names is one line."""
    import torch
    import transformers
    from titan_hf.matrix_folders import tiny_config
    from titan_hf.parallelize import layers_expert_plan
    from titan_hf.validate import expert_plan

    config = tiny_config("afmoe")
    with torch.device("meta"):
        layers = transformers.AutoModelForCausalLM.from_config(config).model.layers
    layers = {str(i): layer for i, layer in enumerate(layers)}
    plan = expert_plan(config)
    concrete = layers_expert_plan(layers, plan, "afmoe")
    assert concrete == {f"layers.1.{path}": style for path, style in plan.items()}
    del layers["1"].mlp.experts.down_proj
    with pytest.raises(ConfigError, match=r"names layers\.1\.mlp\.experts\.down_proj") as info:
        layers_expert_plan(layers, plan, "afmoe")
    _one_line(info)


def test_context_parallel_refuses_an_attention_that_builds_its_own_mask():
    """Doge hands its attention a mask it makes from its own (under cp: a rank's share of
    the) keys; a small copy's forward finds that before launch, where it crashed inside
    every rank ("size of tensor a (16) must match ... (8)"). Llama passes its layer's
    mask on and is not refused."""
    from titan_hf.context_parallel import check_cp
    from titan_hf.matrix_folders import tiny_config

    doge, llama = tiny_config("doge"), tiny_config("llama")
    for config in (doge, llama):
        config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match=r"parallelism\.cp=2: DogeForCausalLM's DogeAttention does not hand") as info:
        check_cp(doge, 2)
    _one_line(info)
    check_cp(llama, 2)


def test_kv_cache_reaches_layers_that_call_it_layer_past(tmp_path):
    """GPT-NeoX and Falcon layers take the cache as ``layer_past``: handed ``cache=`` they
    dropped it into **kwargs and each decoded token attended to itself only (greedy
    generation differed from transformers from the second token). A decoded step now
    equals the whole sequence's logits."""
    import torch
    from titan_hf.matrix_folders import tiny_folder

    from titan_plugins.components.kv_cache import KVCache
    from titan_plugins.hf import load_hf_model

    model = load_hf_model("hf", tiny_folder("gpt_neox", tmp_path / "gpt_neox"),
                          overrides=["data=synthetic", "data.vocab_size=256"]).float()
    assert model.cache_keyword == "layer_past"
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache()
        model(ids[:, :5], cache=cache)
        cache.advance(5)
        step = model(ids[:, 5:], cache=cache)
    torch.testing.assert_close(step[0, -1], whole[0, 5], rtol=0, atol=1e-4)


def test_kv_cache_decoding_is_refused_where_the_attention_builds_its_own_mask(tmp_path):
    """Doge's attention makes its mask from the keys it holds: with a cache its logits moved
    1.2 away from the whole sequence's, so generation (and GRPO rollouts) would sample from
    the wrong distribution. The first cached forward is one line instead; without a cache
    the model runs as before."""
    import torch
    from titan_hf.matrix_folders import tiny_folder

    from titan_plugins.components.kv_cache import KVCache
    from titan_plugins.hf import load_hf_model

    model = load_hf_model("hf", tiny_folder("doge", tmp_path / "doge"), overrides=["data=synthetic", "data.vocab_size=256"])
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        with pytest.raises(ConfigError, match=r"DogeForCausalLM's DogeAttention builds its own attention mask from "
                                              r"its keys; decoding with a KV cache") as info:
            model(ids, cache=KVCache())
    _one_line(info)


def test_grpo_rollouts_on_a_model_that_cannot_decode_stop_before_launch(tmp_path):
    """objective=grpo samples with the KV cache (rollout=native): on Doge that was refused
    only at the first cached forward, inside every rank after launch. Now it is one line
    before any rank starts; SFT on the same folder is not refused, nor is rollout=file
    (completions replayed, nothing decoded)."""
    from omegaconf import OmegaConf
    from titan_hf.matrix_folders import tiny_folder

    from titan_plugins.objectives.rollout import samples_from_the_policy
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import prepare_job

    folder = tiny_folder("doge", tmp_path / "doge")
    grpo = ["model=hf", f"model.hf={folder}", "objective=grpo", "data=prompts", "training.seq_len=64",
            "objective.max_completion_length=8", "objective.num_generations=2", "objective.reward_funcs=[length]"]
    with pytest.raises(ConfigError, match=r"DogeForCausalLM's DogeAttention builds its own attention mask .*"
                                          r"\(objective rollouts decode with it: use rollout=file") as info:
        prepare_job(grpo, get_plugin_manager())
    _one_line(info)
    prepare_job(["model=hf", f"model.hf={folder}", "data=synthetic", "data.vocab_size=256"], get_plugin_manager())
    online = {"objective": {"name": "grpo", "reward_funcs": ["length"]}}
    assert samples_from_the_policy(OmegaConf.create(online))
    assert not samples_from_the_policy(OmegaConf.create({**online, "rollout": {"name": "file"}}))
    assert not samples_from_the_policy(OmegaConf.create({"objective": {"name": "sft"}}))
