"""The real engine of ``rollout=vllm``: :class:`VLLMEngine`, an in-process ``vllm.LLM``
behind :class:`titan_plugins.objectives.rollout_vllm.ColocatedEngine`.

Written against the vLLM that TRL 1.16 supports (``vllm>=0.22,<=0.31``) and with the
names its colocate mode uses (``trl/generation/vllm_generation.py``): ``LLM(...,
distributed_executor_backend="external_launcher", enable_sleep_mode=...)``, each rank
its own engine in the torchrun world (vLLM reads ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE``, which the launcher set); weights into the in-process model through
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``;
``sleep(level=...)``, ``wake_up(tags=[...])``, ``reset_prefix_cache()``; requests as
``TokensPrompt(prompt_token_ids=...)`` with one ``SamplingParams`` per prompt;
adapters as ``LoRARequest(lora_name, lora_int_id, lora_path)``, dropped with
``llm_engine.remove_lora``. vLLM is imported only here, only when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from titan_plugins.config.schema import VLLMRolloutConfig
    from titan_plugins.objectives.rollout_vllm import SamplingRequest
    from titan_plugins.objectives.rollout_vllm_weights import LoraAdapter
    from titan_plugins.spec import ModelSpec

__all__ = ["VLLM_LORA_RANKS", "VLLMEngine", "llm_kwargs", "sampling_kwargs"]


def sampling_kwargs(request: SamplingRequest, index: int) -> dict[str, Any]:
    """``SamplingParams(**...)`` of prompt ``index`` of ``request``."""
    return {
        "n": request.n, "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "max_tokens": request.max_tokens, "seed": request.seeds[index],
        "stop_token_ids": list(request.stop_token_ids),
        "detokenize": False,  # ids in, ids out: the engine has no tokenizer (skip_tokenizer_init)
    }


# vLLM's LoRA ranks (``LoRAConfig.max_lora_rank``): an adapter's rank is rounded up to one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_rank(rank: int) -> int:
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def llm_kwargs(job: Any, spec: ModelSpec | None, options: VLLMRolloutConfig) -> dict[str, Any]:
    """``vllm.LLM(**...)`` of this job: the ``model.hf`` folder, tensor parallel 1, a row's
    longest length (``training.seq_len + 1``: prompt + completion), LoRA slots under ``peft=lora``."""
    from titan_plugins.peft.lora import lora_enabled

    max_len = int(job.training.seq_len) + 1
    if spec is not None:
        from titan_plugins.config.hydra_glue import model_config

        limit = getattr(model_config(job.model, spec), "max_seq_len", None)
        max_len = min(max_len, int(limit)) if isinstance(limit, int) else max_len
    kwargs: dict[str, Any] = {
        "model": str(job.model.hf), "tensor_parallel_size": 1,
        "gpu_memory_utilization": float(options.gpu_memory_utilization),
        "enable_sleep_mode": bool(options.enable_sleep_mode), "dtype": str(options.dtype),
        "enforce_eager": bool(options.enforce_eager), "max_model_len": max_len,
        "distributed_executor_backend": "external_launcher",  # in this process, in the torchrun world
        "seed": int(job.training.seed),  # each request carries its own seed anyway
        "skip_tokenizer_init": True,
        "max_num_batched_tokens": 4096,  # TRL: the v1 memory profiler over-reserves at the default
    }
    if lora_enabled(job):
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(int(job.peft.rank)))
    return kwargs


class VLLMEngine:
    """A ``ColocatedEngine`` over ``llm``, a ``vllm.LLM`` of this process (module docstring)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    @classmethod
    def create(cls, kwargs: dict[str, Any]) -> VLLMEngine:
        from vllm import LLM

        return cls(LLM(**kwargs))

    def generate(self, prompts: list[list[int]], request: SamplingRequest,
                 lora: LoraAdapter | None) -> list[list[list[int]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        params = [SamplingParams(**sampling_kwargs(request, i)) for i in range(len(prompts))]
        lora_request = None if lora is None else LoRARequest(lora.name, lora.lora_id, str(lora.path))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling_params=params,
                                    use_tqdm=False, lora_request=lora_request)
        # LLM.generate answers in the prompts' order; a request's samples by their index
        return [[list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)

    def remove_lora(self, lora_id: int) -> None:
        self.llm.llm_engine.remove_lora(lora_id)

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
