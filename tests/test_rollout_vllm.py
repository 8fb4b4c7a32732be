"""rollout=vllm without vLLM or a GPU: the engine is a fake that records what it is asked.
The request built from the job's knobs (and its vLLM SamplingParams), completions in
TRL's group-major order with the EOS kept, the sleep / push / wake protocol around a
step, the weight push (Hugging Face names, every parameter once, buckets within the
limit, a larger tensor alone, the values of the full parameters, FSDP2 shards gathered on
two gloo ranks), LoRA (the base once, adapters under a new id per update) and each
refusal's one line."""

from __future__ import annotations

import dataclasses
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.data.prompt_source import PromptDataset
from titan_plugins.data.tokenizer import build_tokenizer
from titan_plugins.errors import ConfigError
from titan_plugins.objectives.grpo import GRPOObjective
from titan_plugins.objectives.job import step_seed
from titan_plugins.objectives.rollout import build_engine
from titan_plugins.objectives.rollout_vllm import VLLMRollout, check_vllm_runtime
from titan_plugins.objectives.rollout_vllm_llm import VLLMEngine, llm_kwargs, sampling_kwargs
from titan_plugins.objectives.rollout_vllm_weights import MIB, WeightPusher
from titan_plugins.testing.grpo import OneRankView, grpo_job

pytest.importorskip("titan_qwen3")
EOS = 2047  # the shipped ChatML tokenizer's <|im_end|>, its only EOS id


class FakeEngine:
    """A ColocatedEngine that records every call; ``generate`` answers from ``script``."""

    def __init__(self, script=None):
        self.events, self.loaded, self.requests = [], [], []
        self.script = script or (lambda prompt, g: [len(prompt), g, EOS])

    def generate(self, prompts, request, lora):
        self.events.append(("generate", None if lora is None else lora.lora_id))
        self.requests.append((prompts, request, lora))
        return [[self.script(p, g) for g in range(request.n)] for p in prompts]

    def load_weights(self, weights):
        self.events.append(("load", len(weights)))
        self.loaded.append([(name, value.clone()) for name, value in weights])

    def remove_lora(self, lora_id):
        self.events.append(("remove_lora", lora_id))

    def sleep(self, level):
        self.events.append(("sleep", level))

    def wake_up(self, tags):
        self.events.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache", None))


def _job(tmp_path, rows=None, **overrides):
    path = tmp_path / "prompts.jsonl"
    rows = rows or [{"prompt": "1+1=", "answer": "2"}, {"prompt": "What is 12 times 34, step by step?", "answer": "408"},
                    {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    job = grpo_job(path, None, rollout="vllm", seed=11)
    extra = {"parallelism": {"pp": 1, "tp": 1}, "peft": {"method": "none", "rank": 4}, "model": {"hf": "hf-folder"},
             "rollout": {"vllm": {"bucket_mb": 2}}}
    return OmegaConf.merge(job, extra, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


def _objective(**knobs):
    config = dict(num_generations=3, max_completion_length=5, temperature=0.7, top_p=0.9, top_k=0,
                  reward_funcs=["accuracy"])
    config.update(knobs)
    return GRPOObjective(SimpleNamespace(**config))


def _rows(job, positions=(0, 1, 2)):
    data = PromptDataset(job.data, build_tokenizer(job.data), dp_rank=0, dp_world=1, seq_len=64, seed=0)
    return [data.prompt_row(p) for p in positions]


@pytest.fixture(scope="module")
def model():
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import build

    torch.manual_seed(0)
    m = build(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2))  # tied embeddings, as the debug flavor
    m.init_weights()
    return m


def _to_hf():
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2)).to_hf


# ------------------------------------------------------------------ the request and the answer
def test_the_request_carries_the_jobs_knobs_and_maps_to_vllm_sampling_params(tmp_path):
    job = _job(tmp_path)
    rows = _rows(job)
    rollout = VLLMRollout(job, _objective(), engine=FakeEngine(), pusher=WeightPusher(_to_hf(), 2))
    request = rollout.request(5, rows, 3)
    assert (request.n, request.temperature, request.top_p, request.top_k, request.max_tokens) == (3, 0.7, 0.9, -1, 5)
    assert request.stop_token_ids == [EOS]
    # rollout=native's seed of each group's first completion: (training.seed, position x G, step)
    assert request.seeds == [step_seed(11, row.position * 3, 5) for row in rows]
    assert len(set(request.seeds)) == 3 and rollout.request(6, rows, 3).seeds != request.seeds
    assert VLLMRollout(job, _objective(top_k=7), engine=FakeEngine()).request(5, rows, 3).top_k == 7
    assert sampling_kwargs(request, 1) == {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 5,
                                           "seed": request.seeds[1], "stop_token_ids": [EOS], "detokenize": False}


def test_vllm_engine_adapter_builds_vllms_objects(tmp_path, monkeypatch):
    """VLLMEngine against stand-ins of vllm's modules: SamplingParams per prompt, token prompts,
    a LoRARequest, samples put back in index order, load_weights into the in-process model."""
    made = {}
    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: ("params", kw)
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    lora = ModuleType("vllm.lora.request")
    lora.LoRARequest = lambda name, lora_id, path: ("lora", name, lora_id, path)
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora)):
        monkeypatch.setitem(sys.modules, name, module)

    class LLM:
        def generate(self, prompts, sampling_params, use_tqdm, lora_request):
            made.update(prompts=prompts, params=sampling_params, lora=lora_request)
            out = lambda i, ids: SimpleNamespace(index=i, token_ids=ids)  # noqa: E731
            return [SimpleNamespace(outputs=[out(1, (8, EOS)), out(0, (7,))]) for _ in prompts]

    llm = LLM()
    llm.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
        model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=lambda w: made.update(weights=w))))))
    job = _job(tmp_path)
    request = VLLMRollout(job, _objective(num_generations=2), engine=FakeEngine()).request(1, _rows(job, (0, 1)), 2)
    from titan_plugins.objectives.rollout_vllm_weights import LoraAdapter

    got = VLLMEngine(llm).generate([[1, 2], [3]], request, LoraAdapter("policy-4", 4, tmp_path))
    assert got == [[[7], [8, EOS]], [[7], [8, EOS]]]
    assert made["prompts"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert [p[1]["seed"] for p in made["params"]] == request.seeds and made["params"][0][1]["n"] == 2
    assert made["lora"] == ("lora", "policy-4", 4, str(tmp_path))
    VLLMEngine(llm).load_weights([("a", torch.ones(1))])
    assert made["weights"][0][0] == "a"


def test_llm_kwargs_follow_the_job(tmp_path):
    job = _job(tmp_path, **{"training.seq_len": 96, "rollout.vllm.gpu_memory_utilization": 0.45})
    kwargs = llm_kwargs(job, None, VLLMRollout(job, _objective(), engine=FakeEngine()).options)
    assert kwargs["model"] == "hf-folder" and kwargs["tensor_parallel_size"] == 1
    assert kwargs["gpu_memory_utilization"] == 0.45 and kwargs["enable_sleep_mode"] is True
    assert kwargs["max_model_len"] == 97 and kwargs["skip_tokenizer_init"] and "enable_lora" not in kwargs
    lora = llm_kwargs(_job(tmp_path, **{"peft.method": "lora", "peft.rank": 12}), None,
                      VLLMRollout(job, _objective(), engine=FakeEngine()).options)
    assert (lora["enable_lora"], lora["max_loras"], lora["max_lora_rank"]) == (True, 1, 16)  # vLLM's ranks


def test_completions_come_back_group_major_with_the_eos_kept(tmp_path, model):
    def script(prompt, g):  # prompt length and sample index say who is who; g=1 runs past its EOS; g=2 truncated
        return [[len(prompt), 0, EOS], [len(prompt), 1, EOS, 99, 98], [len(prompt), 2, 5, 6, 7]][g]

    job = _job(tmp_path)
    rows = _rows(job)
    lengths = [len(r.ids) for r in rows]
    assert len(set(lengths)) == 3  # prompts of different lengths
    engine = FakeEngine(script)
    rollout = VLLMRollout(job, _objective(), engine=engine, pusher=WeightPusher(_to_hf(), 2))
    run = OneRankView(job, model, None, tmp_path)
    done = rollout.complete(run, 1, 0, rows, 3)
    assert done.ids == [c for n in lengths for c in ([n, 0, EOS], [n, 1, EOS], [n, 2, 5, 6, 7])]
    assert engine.requests[0][0] == [r.ids for r in rows]  # the prompts as token ids, in the rows' order


def test_a_step_pushes_once_then_generates_and_sleeps_after_its_last_microbatch(tmp_path, model):
    job = _job(tmp_path)
    rows = _rows(job)
    engine = FakeEngine()
    rollout = VLLMRollout(job, _objective(), engine=engine, pusher=WeightPusher(_to_hf(), 2))
    run = OneRankView(job, model, None, tmp_path)
    run.accum = 2
    for step in (1, 2):
        for micro in (0, 1):
            rollout.complete(run, step, micro, rows[micro:micro + 2], 3)
    kinds = [e[0] for e in engine.events]
    loads = kinds.count("load") // 2
    assert loads > 1 and kinds.count("load") == 2 * loads  # the same buckets at each step
    push = ["load"] * loads + ["reset_prefix_cache"]
    assert kinds == [*push, "generate", "generate", "sleep",
                     "wake_up", *push, "wake_up", "generate", "generate", "sleep"]
    assert [e for e in engine.events if e[0] in ("sleep", "wake_up")] == [
        ("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 2)]  # full: level 2


# ------------------------------------------------------------------ the weight push
def _check_push(loaded, limit, want):
    """Every bucket within ``limit`` bytes unless alone; every tensor once; ``want``'s names and values."""
    names = [n for bucket in loaded for n, _ in bucket]
    sizes = [sum(v.numel() * v.element_size() for _, v in bucket) for bucket in loaded]
    assert all(size <= limit or len(bucket) == 1 for size, bucket in zip(sizes, loaded, strict=True))
    assert any(len(b) > 1 for b in loaded) and any(s > limit for s in sizes)  # shared buckets and one alone
    assert len(names) == len(set(names)) and set(names) == set(want)
    for bucket in loaded:
        for name, value in bucket:
            assert torch.equal(value, want[name]), name


def test_full_weights_go_in_buckets_under_hugging_face_names(model):
    engine = FakeEngine()
    WeightPusher(_to_hf(), 2).push([model], engine)
    want = _to_hf()(model.state_dict())
    assert "model.embed_tokens.weight" in want and "lm_head.weight" not in want  # tied: vLLM ties it back
    assert "model.layers.1.mlp.gate_proj.weight" in want
    _check_push(engine.loaded, 2 * MIB, want)


def _fsdp_push_rank(rank: int, world: int) -> dict:
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import build
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    m = build(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2))
    m.init_weights()
    want = _to_hf()({k: v.clone() for k, v in m.state_dict().items()})
    mesh = init_device_mesh("cpu", (world,))
    for layer in m.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in m.parameters())
    engine = FakeEngine()
    WeightPusher(_to_hf(), 2).push([m], engine)
    _check_push(engine.loaded, 2 * MIB, want)
    return {"buckets": len(engine.loaded), "tensors": sum(len(b) for b in engine.loaded)}


@pytest.mark.slow  # two gloo ranks: their start-up is most of it
def test_fsdp2_shards_are_gathered_to_the_full_parameters_on_every_rank():
    from titan_plugins.testing.gloo import run_ranks

    results = run_ranks(_fsdp_push_rank, 2, timeout=120)
    assert results[0] == results[1] and results[0]["tensors"] == len(_to_hf()(_plain_state()))


def _plain_state():
    from titan_qwen3.config import FLAVORS
    from titan_qwen3.model import build

    with torch.device("meta"):
        return build(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2)).state_dict()


def test_lora_pushes_adapters_only_under_a_new_id_per_update(tmp_path, model):
    import copy

    from safetensors.torch import load_file, save_file

    from titan_plugins.peft.config import PeftConfig
    from titan_plugins.peft.lora import apply_lora, is_adapter_key

    lora = copy.deepcopy(model)
    apply_lora(lora, PeftConfig(rank=4, target_modules=["wq", "wv"]))
    for name, p in lora.named_parameters():
        if is_adapter_key(name):
            torch.nn.init.normal_(p)
    job = _job(tmp_path, **{"peft.method": "lora"})
    pusher = WeightPusher(_to_hf(), 2, tmp_path / "vllm-lora", lambda folder, t: save_file(t, str(folder / "a.st")))
    engine = FakeEngine()
    rollout = VLLMRollout(job, _objective(), engine=engine, pusher=pusher)
    run = OneRankView(job, lora, None, tmp_path)
    rows = _rows(job)
    rollout.complete(run, 1, 0, rows, 3)
    adapters = {k: v.detach().clone() for k, v in lora.named_parameters() if is_adapter_key(k)}
    assert len(adapters) == 8  # 2 layers x (wq, wv) x (A, B)
    saved = load_file(str(pusher.lora.path / "a.st"))
    assert saved.keys() == adapters.keys() and all(torch.equal(saved[k], adapters[k]) for k in adapters)
    key = "layers.0.attention.wq.lora_B.weight"
    with torch.no_grad():
        lora.get_parameter(key).add_(1.0)  # the optimizer's update
    rollout.complete(run, 2, 0, rows, 3)
    assert engine.loaded == []  # the base is the engine's own (model.hf), never pushed
    assert engine.events == [
        ("reset_prefix_cache", None), ("generate", 1), ("sleep", 1),
        ("wake_up", ("weights",)), ("remove_lora", 1), ("reset_prefix_cache", None), ("wake_up", ("kv_cache",)),
        ("generate", 2), ("sleep", 1)]  # level 1: the base stays
    assert [adapter.lora_id for _, _, adapter in engine.requests] == [1, 2]
    assert not (tmp_path / "vllm-lora" / "update-1").exists() and pusher.lora.path.name == "update-2"
    second = load_file(str(tmp_path / "vllm-lora" / "update-2" / "a.st"))
    assert torch.equal(second[key], adapters[key] + 1.0)  # the updated adapter, the others as they were
    assert all(torch.equal(second[k], adapters[k]) for k in adapters if k != key)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("overrides, message", [
    ({"parallelism.pp": 2}, "rollout=vllm with parallelism.pp=2: each rank's engine holds the whole policy"),
    ({"parallelism.tp": 2}, "rollout=vllm with parallelism.tp=2: one engine per rank with tensor parallel 1"),
    ({"parallelism.ep": 2}, "rollout=vllm with parallelism.ep=2: not done yet (the weight push gathers"),
    ({"peft.method": "qlora"}, "rollout=vllm with peft.method=qlora: the 4-bit NF4 base cannot be pushed"),
    ({"peft.method": "lora", "peft.rank": 1024}, "rollout=vllm with peft.rank=1024: above vLLM's largest LoRA"),
    ({"model.hf": "null"}, "rollout=vllm with model.hf=null: vLLM builds its engine from a Hugging Face folder"),
    ({"peft.method": "lora", "checkpoint.init_from": "seed"},
     "rollout=vllm with peft=lora and checkpoint.init_from=seed: vLLM's base is model.hf's folder"),
    ({"peft.method": "lora", "model.hf_partial": "true"},
     "rollout=vllm with peft=lora and model.hf_partial=true: vLLM's engine loads the base from the folder"),
])
def test_what_rollout_vllm_cannot_run_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        VLLMRollout(_job(tmp_path, **overrides), _objective(), engine=FakeEngine())
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_no_vllm_or_no_gpu_is_one_line_before_any_engine(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        build_engine(_job(tmp_path), _objective())  # what objective.check runs before launch
    assert str(err.value) == "rollout=vllm: vLLM is not installed (pip install 'titan-plugins[vllm]')"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_vllm_runtime()
    assert str(err.value).startswith("rollout=vllm: CUDA is not available") and "\n" not in str(err.value)


def test_titan_run_refuses_before_launch(tmp_path):
    """The config group (``rollout=vllm``, its typed ``rollout.vllm``) and the refusal wired into
    the pre-launch checks: one line, no rank started."""
    from titan_plugins.train.api import run

    tiny = ["model=qwen3", "model.n_layers=2", "objective=grpo", "data=prompts", "training.seq_len=64",
            "objective.max_completion_length=12", "objective.num_generations=4", "rollout=vllm",
            "rollout.vllm.bucket_mb=64"]
    with pytest.raises(ConfigError) as err:
        run(tiny, run_dir=tmp_path / "refused", timeout=60)
    assert str(err.value) == ("rollout=vllm with model.hf=null: vLLM builds its engine from a Hugging Face folder "
                              "(model.hf=FOLDER)")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
