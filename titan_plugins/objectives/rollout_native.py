"""``rollout=native``: completions sampled from the live policy, on the training ranks
and their sharded weights, with the KV cache (``titan_plugins.components.kv_cache``).

One microbatch's prompts decode together: each prompt ``num_generations`` times,
left-padded to the longest (the cache keeps every real token from attending to the
padding), one forward for the prompts, then one position per forward. Sampling is
``objective.temperature`` / ``top_k`` / ``top_p`` (``components.sampling``, transformers'
order); a completion ends with its first EOS id (the tokenizer's and
generation_config.json's, which it keeps: TRL's completion) or at
``max_completion_length`` tokens. Each completion draws from its own stream of uniforms,
seeded by ``(training.seed, step, the prompt's global position, its index in the
group)``, one per token, inverting that token's CDF: the same completions at any
data-parallel layout and after a resume, in one batched draw per token. Under data parallelism
every rank runs the same number of forwards (FSDP gathers weights in each): the ranks
agree after each token whether all their rows are done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_plugins.components.kv_cache import KVCache
from titan_plugins.components.sampling import SamplingConfig, sample_by_uniforms
from titan_plugins.loss.token_logps import last_logits
from titan_plugins.objectives.job import step_seed
from titan_plugins.objectives.rollout import Completions, rollout_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from titan_plugins.data.prompt_source import PromptRow
    from titan_plugins.objectives.job import JobView

__all__ = ["NativeRollout", "sample_completions"]


def _all_done(done: torch.Tensor, group: ProcessGroup | None) -> bool:
    flag = done.all().to(torch.int32).reshape(1)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@torch.no_grad()
def sample_completions(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], cfg: SamplingConfig,
                       stops: list[int], pad_id: int, device: torch.device,
                       group: ProcessGroup | None = None) -> list[list[int]]:
    """One completion per prompt (each its own generator, ``seeds[i]``), each ending
    with its first id of ``stops`` or after ``cfg.max_new_tokens``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    pad = torch.ones(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        pad[i, width - len(p):] = False
    ids, pad = ids.to(device), pad.to(device)
    # each completion's whole stream of uniforms up front, from its own generator: one
    # batched draw per token after that (sample_by_uniforms), not a call per row
    uniforms = torch.stack([torch.rand(cfg.max_new_tokens, generator=torch.Generator().manual_seed(s))
                            for s in seeds]).to(device)
    cache = KVCache(pad)
    stop = torch.tensor(stops or [pad_id], dtype=torch.int64, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    new: list[torch.Tensor] = []
    step_in = ids
    for t in range(cfg.max_new_tokens):
        logits = last_logits(model(step_in, cache=cache))
        if isinstance(logits, DTensor):  # TP's loss_parallel head: the vocabulary is sharded over tp
            logits = logits.full_tensor()
        cache.advance(step_in.shape[1])
        nxt = sample_by_uniforms(logits, cfg, uniforms[:, t])
        nxt = torch.where(done, stop[0], nxt)
        done = done | torch.isin(nxt, stop)
        new.append(nxt)
        step_in = nxt.unsqueeze(1)
        if _all_done(done, group):
            break
    tokens = torch.stack(new, dim=1).tolist()
    out = []
    stop_set = set(stop.tolist())
    for row in tokens:
        end = next((k for k, t in enumerate(row) if t in stop_set), len(row) - 1)
        out.append(row[: end + 1])
    return out


class NativeRollout:
    """The engine of ``rollout=native`` (module docstring)."""

    name = "native"

    def __init__(self, job: Any, objective: Any) -> None:
        from titan_plugins.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(job.data)
        self.stops = [int(i) for i in tokenizer.eos_ids] or [int(tokenizer.eos_id)]
        self.pad_id = int(tokenizer.pad_id)
        self.seed = int(job.training.seed)
        self.cfg = SamplingConfig(max_new_tokens=int(objective.max_completion_length),
                                  temperature=float(objective.temperature), top_k=int(objective.top_k),
                                  top_p=float(objective.top_p))
        self.cfg.check()

    def complete(self, run: JobView, step: int, micro: int, rows: list[PromptRow],
                 num_generations: int) -> Completions:
        from titan_plugins.distributed.forward_only import moe_counters_kept, resharded

        prompts = [row.ids for row in rows for _ in range(num_generations)]
        seeds = [step_seed(self.seed, row.position * num_generations + g, step)
                 for row in rows for g in range(num_generations)]
        parts = run.model.parts
        with moe_counters_kept(parts), resharded(parts):
            ids = sample_completions(parts[0], prompts, seeds, self.cfg, self.stops, self.pad_id, run.device,
                                     rollout_group(run))
        return Completions(ids)
