"""``rollout=vllm``: completions sampled by vLLM colocated with training, the live policy's
weights pushed to it after each optimizer update.

Which ranks: every training rank owns an in-process engine on its own GPU, with tensor
parallel 1. GRPO trains on data-parallel layouts (TP and PP refused), each data-parallel
rank samples its own prompts, and FSDP's all-gather (``DTensor.full_tensor``) leaves the
full tensor on every rank anyway: one gather feeds every engine, nothing is broadcast
(TRL's ``vllm_mode="colocate"`` with ``vllm_tensor_parallel_size=1``).

A step, as TRL 1.16's colocate mode does it (``trl/generation/vllm_generation.py``):

1. At the step's first microbatch (the weights changed since the last generation): wake
   the weights (``wake_up(tags=["weights"])``), push them in buckets of at most
   ``rollout.vllm.bucket_mb`` MiB (``load_weights``; ``rollout_vllm_weights.py``), reset
   the prefix cache (its KV came from the old weights). Under ``peft=lora`` only the
   adapters go, as a PEFT folder under a new LoRA id; the frozen base is ``model.hf``'s,
   loaded once when the engine was built (``rollout_vllm_weights.py`` says why).
2. Each microbatch: wake the KV cache, one request per prompt (``n = num_generations``),
   the completions back in TRL's group-major order.
3. After the step's last microbatch (``run.accum``): sleep, so that training has the GPU.
   Level 2 under full fine-tuning (the weights are discarded: all of them are pushed again
   before the next generation), level 1 under LoRA (the folder's base, never pushed, is kept).

In-process, generation is synchronous: no request is in flight while weights load, so the
pause / update / resume of vLLM's weight-transfer API (``pause_generation``,
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, a
``WeightTransferConfig`` backend for a trainer in another process) reduces to sleep /
``load_weights`` / ``wake_up`` here. Sampling: ``objective.temperature`` / ``top_p`` /
``top_k`` (0: off, vLLM's -1), at most ``max_completion_length`` new tokens, stopping at the
tokenizer's EOS ids, which the completion keeps (as ``rollout=native``). Each prompt's
request is seeded by ``(training.seed, step, its global position)`` as ``rollout=native``
seeds a group's first completion; vLLM seeds the group's ``g``-th sample ``seed + g``.

The engine is any object with :class:`ColocatedEngine`'s methods; ``vllm.LLM`` is one
(``rollout_vllm_llm.py``), imported only when the engine is built, and tests use a fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from titan_plugins.errors import ConfigError
from titan_plugins.objectives.job import step_seed
from titan_plugins.objectives.rollout import Completions
from titan_plugins.objectives.rollout_vllm_llm import VLLM_LORA_RANKS  # no vLLM import until called

if TYPE_CHECKING:
    import torch

    from titan_plugins.config.schema import VLLMRolloutConfig
    from titan_plugins.data.prompt_source import PromptRow
    from titan_plugins.objectives.job import JobView
    from titan_plugins.objectives.rollout_vllm_weights import LoraAdapter, WeightPusher

__all__ = ["ColocatedEngine", "SamplingRequest", "VLLMRollout", "check_vllm_layout", "check_vllm_runtime",
           "group_major", "vllm_options"]



@dataclass(frozen=True)
class SamplingRequest:
    """One microbatch's request: each prompt ``n`` times, ``seeds[i]`` seeding prompt ``i``."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # -1: every token (vLLM's "off")
    max_tokens: int
    seeds: list[int]
    stop_token_ids: list[int]


class ColocatedEngine(Protocol):
    """What the rollout needs of an in-process engine (``rollout_vllm_llm.VLLMEngine``)."""

    def generate(self, prompts: list[list[int]], request: SamplingRequest,
                 lora: LoraAdapter | None) -> list[list[list[int]]]:
        """Per prompt, its ``request.n`` completions' token ids, in sample order."""
        ...

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy these full tensors (Hugging Face names) into the engine's model."""
        ...

    def remove_lora(self, lora_id: int) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...

    def reset_prefix_cache(self) -> None: ...


def vllm_options(job: Any) -> VLLMRolloutConfig:
    """``rollout.vllm`` over the schema's defaults (a job without the key gets them all)."""
    from omegaconf import OmegaConf

    from titan_plugins.config.schema import VLLMRolloutConfig

    rollout = job.get("rollout") if hasattr(job, "get") else getattr(job, "rollout", None)
    given = rollout.get("vllm") if rollout is not None and hasattr(rollout, "get") else None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VLLMRolloutConfig), given or {}))


def check_vllm_layout(job: Any) -> None:
    """What ``rollout=vllm`` cannot run, in one line naming the key and its value."""
    from titan_plugins.peft.qlora import qlora_enabled

    par = job.parallelism
    if int(par.pp) > 1:
        raise ConfigError(f"rollout=vllm with parallelism.pp={par.pp}: each rank's engine holds the whole "
                          "policy, pushed from every stage's weights; use FSDP/HSDP without PP")
    if int(par.tp) > 1:
        raise ConfigError(f"rollout=vllm with parallelism.tp={par.tp}: one engine per rank with tensor parallel 1 "
                          "for now; use FSDP/HSDP without TP")
    if int(par.get("ep", 1) or 1) > 1:  # the weight push has not been run on expert-sharded weights
        raise ConfigError(f"rollout=vllm with parallelism.ep={par.ep}: not done yet (the weight push gathers "
                          "FSDP shards only); use rollout=native under EP, or FSDP/HSDP without EP")
    if qlora_enabled(job):
        raise ConfigError("rollout=vllm with peft.method=qlora: the 4-bit NF4 base cannot be pushed to vLLM; "
                          "use peft=lora or full fine-tuning")
    peft = job.get("peft")
    if not job.model.get("hf"):
        raise ConfigError("rollout=vllm with model.hf=null: vLLM builds its engine from a Hugging Face folder "
                          "(model.hf=FOLDER)")
    peft = job.get("peft")
    if peft is not None and str(getattr(peft.method, "value", peft.method)) == "lora":
        if int(peft.rank) > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"rollout=vllm with peft.rank={peft.rank}: above vLLM's largest LoRA rank "
                              f"{VLLM_LORA_RANKS[-1]}")
        # the engine's base is the folder's (pushed adapters only): the run's base must be it too
        init_from = job.get("checkpoint", {}).get("init_from")
        if init_from:
            raise ConfigError(f"rollout=vllm with peft=lora and checkpoint.init_from={init_from}: vLLM's base is "
                              f"model.hf's folder, not the run's; export the base as a folder and set model.hf")
        if job.model.get("hf_partial"):
            raise ConfigError("rollout=vllm with peft=lora and model.hf_partial=true: vLLM's engine loads the base "
                              "from the folder (only adapters are pushed), and the folder lacks part of it")


def check_vllm_runtime() -> None:
    """vLLM importable and a GPU to run it on (before any rank starts)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout=vllm: vLLM is not installed (pip install 'titan-plugins[vllm]')")
    if not torch.cuda.is_available():
        raise ConfigError("rollout=vllm: CUDA is not available (vLLM generates on a GPU; "
                          "rollout=native samples on CPU)")


def until_stop(ids: list[int], stops: set[int]) -> list[int]:
    """``ids`` up to and with its first stop id (``rollout=native``'s completion)."""
    end = next((k for k, t in enumerate(ids) if t in stops), None)
    return list(ids) if end is None else list(ids[: end + 1])


def group_major(outputs: list[list[list[int]]], prompts: int, n: int, stops: set[int]) -> list[list[int]]:
    """The engine's per-prompt groups as TRL's flat order (prompt 0's ``n``, then prompt 1's, ...)."""
    if len(outputs) != prompts or any(len(group) != n for group in outputs):
        raise RuntimeError(f"rollout=vllm: the engine returned {[len(g) for g in outputs]} completions per prompt "
                           f"for {prompts} prompts x objective.num_generations={n}")
    return [until_stop(ids, stops) for group in outputs for ids in group]


class VLLMRollout:
    """The engine of ``rollout=vllm`` (module docstring). ``engine`` and ``pusher``:
    given by tests; else built at the first generation from the run."""

    name = "vllm"

    def __init__(self, job: Any, objective: Any, *, engine: ColocatedEngine | None = None,
                 pusher: WeightPusher | None = None) -> None:
        from titan_plugins.data.tokenizer import build_tokenizer
        from titan_plugins.peft.lora import lora_enabled

        check_vllm_layout(job)
        if engine is None:
            check_vllm_runtime()
        self.job, self.options = job, vllm_options(job)
        tokenizer = build_tokenizer(job.data)
        self.stops = [int(i) for i in tokenizer.eos_ids] or [int(tokenizer.eos_id)]
        self.seed = int(job.training.seed)
        self.max_tokens = int(objective.max_completion_length)
        self.temperature, self.top_p = float(objective.temperature), float(objective.top_p)
        self.top_k = int(objective.top_k) or -1  # ours: 0 is off; vLLM's off is -1
        self.lora = lora_enabled(job)
        # level 2 drops the weights (all pushed again anyway); under LoRA the folder's base must survive
        self.sleep_level = 1 if self.lora else 2
        self.engine, self.pusher = engine, pusher
        self.pushed_step: int | None = None
        self.asleep: set[str] = set()

    def request(self, step: int, rows: list[PromptRow], num_generations: int) -> SamplingRequest:
        return SamplingRequest(
            n=num_generations, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, stop_token_ids=list(self.stops),
            seeds=[step_seed(self.seed, row.position * num_generations, step) for row in rows])

    def complete(self, run: JobView, step: int, micro: int, rows: list[PromptRow],
                 num_generations: int) -> Completions:
        engine, pusher = self._build(run)
        if self.pushed_step != step:  # the first generation since the last optimizer update
            self._wake(engine, "weights")
            pusher.push(run.model.parts, engine)
            engine.reset_prefix_cache()  # its KV came from the old weights
            self.pushed_step = step
        self._wake(engine, "kv_cache")
        outputs = engine.generate([list(row.ids) for row in rows], self.request(step, rows, num_generations),
                                  pusher.lora)
        ids = group_major(outputs, len(rows), num_generations, set(self.stops))
        if self.options.enable_sleep_mode and micro + 1 >= int(getattr(run, "accum", 1) or 1):
            engine.sleep(self.sleep_level)  # the step's last microbatch: the GPU goes back to training
            self.asleep = {"weights", "kv_cache"}
        return Completions(ids)

    def _wake(self, engine: ColocatedEngine, tag: str) -> None:
        if tag in self.asleep:
            engine.wake_up([tag])
            self.asleep.discard(tag)

    def _build(self, run: JobView) -> tuple[ColocatedEngine, WeightPusher]:
        if self.pusher is None:
            from titan_plugins.objectives.rollout_vllm_weights import pusher_for_run

            self.pusher = pusher_for_run(run, self.options.bucket_mb, self.lora)
        if self.engine is None:
            from titan_plugins.objectives.rollout_vllm_llm import VLLMEngine, llm_kwargs

            self.engine = VLLMEngine.create(llm_kwargs(run.job, run.spec, self.options))
        return self.engine, self.pusher
