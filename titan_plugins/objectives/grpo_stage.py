"""``objective=grpo``'s rollout stage, before a step's microbatches.

For each microbatch of prompts (``data.name=prompts``' ``Batch.rows``) the engine
(``rollout=native|file``, ``rollout.py``) returns ``num_generations`` completions per
prompt; then, as TRL's ``_generate_and_score_completions`` does for its generation batch:
every completion is decoded (special tokens skipped; a conversational prompt's completion
is ``[{"role": "assistant", "content": text}]``), this rank's completions are scored in
one call per reward function, the reward table of every data-parallel rank is gathered,
the advantages and the rollout metrics are computed over the whole global batch, and
each rank keeps its rows. With ``num_iterations > 1`` the sampling policy's log-probs
are computed once (a forward without gradient) and the rows are trained on
``num_iterations`` steps in a row; a run resumed inside such a cycle samples anew at
its first step. Rank 0 appends the step's completions to ``completions.jsonl``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from titan_plugins.errors import ConfigError
from titan_plugins.objectives.grpo_loss import advantages, rollout_metrics
from titan_plugins.objectives.rollout import (
    RolloutBatch,
    build_engine,
    is_truncated,
    row_width,
    training_rows,
    write_completions,
)

if TYPE_CHECKING:
    from titan_plugins.objectives.grpo import GRPOObjective
    from titan_plugins.objectives.job import JobView

__all__ = ["RolloutStage"]


def _gather(run: JobView, local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every data-parallel rank's ``local`` rows, rank by rank, and this rank's index."""
    if run.dp_group is None:
        return local, 0
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(run.dp_group))]
    dist.all_gather(parts, local.contiguous(), group=run.dp_group)
    return torch.cat(parts), dist.get_rank(run.dp_group)


class RolloutStage:
    """Turns a step's prompt batches into ``RolloutBatch`` es (module docstring)."""

    def __init__(self, run: JobView, objective: GRPOObjective) -> None:
        from titan_plugins.data.tokenizer import build_tokenizer

        self.objective = objective
        self.engine = build_engine(run.config, objective)
        self.tokenizer = build_tokenizer(run.config.data)
        self.stops = {int(i) for i in self.tokenizer.eos_ids} | {int(self.tokenizer.pad_id)}
        self.pad_id = int(self.tokenizer.pad_id)
        self.seq_len = int(run.config.training.seq_len)
        self.rewards = objective.load_rewards(str(run.device))
        self.weights = torch.tensor(objective.reward_weights, dtype=torch.float32)
        self.cycle: tuple[int, list[RolloutBatch], dict[str, float]] | None = None

    def __call__(self, run: JobView, step: int, batches: list[Any]) -> tuple[list[RolloutBatch], dict[str, float]]:
        n_iter = self.objective.num_iterations
        start = (step - 1) // n_iter * n_iter + 1  # the first step of this generation batch's cycle
        if self.cycle is not None and self.cycle[0] == start and step != start:
            # the same completions, the old log-probs kept; nothing generated or scored this step
            return self.cycle[1], {**self.cycle[2], "time/generation_s": 0.0, "time/scoring_s": 0.0}
        out, metrics = self.generate(run, step, batches)
        self.cycle = (start, out, metrics) if n_iter > 1 else None
        return out, metrics

    # ------------------------------------------------------------------ parts
    def _decode(self, ids: list[int], conversational: bool) -> Any:
        text = self.tokenizer.tok.decode([int(i) for i in ids], skip_special_tokens=True)
        return [{"role": "assistant", "content": text}] if conversational else text

    def _sample(self, run: JobView, step: int, batches: list[Any]) -> list[tuple[list[Any], Any]]:
        objective = self.objective
        G, room = objective.num_generations, self.seq_len + 1 - objective.max_completion_length
        out = []
        for micro, batch in enumerate(batches):
            rows = getattr(batch, "rows", None)
            if not rows:
                raise ConfigError(f"objective.name=grpo needs prompt rows, and data.name={run.config.data.name} "
                                  "hands none over (use data=prompts)")
            for row in rows:
                if len(row.ids) > room:
                    raise ConfigError(f"{row.where}: the prompt is {len(row.ids)} tokens; with objective."
                                      f"max_completion_length={objective.max_completion_length} a row needs "
                                      f"{len(row.ids) + objective.max_completion_length - 1} positions, over "
                                      f"training.seq_len={self.seq_len}")
            done = self.engine.complete(run, step, micro, rows, G)
            if len(done.ids) != len(rows) * G:
                raise ConfigError(f"rollout={self.engine.name}: {len(done.ids)} completions for {len(rows)} prompts "
                                  f"x objective.num_generations={G}")
            for ids in done.ids:
                if len(ids) > objective.max_completion_length:
                    raise ConfigError(f"rollout={self.engine.name}: a completion of {len(ids)} tokens is over "
                                      f"objective.max_completion_length={objective.max_completion_length}")
            out.append((rows, done))
        return out

    def _given(self, sampled: list[tuple[list[Any], Any]]) -> dict[str, list[Any]] | None:
        names = [set(done.rewards or {}) for _, done in sampled]
        if any(n != names[0] for n in names):
            raise ConfigError(f"rollout={self.engine.name}: the microbatches of a step give rewards for different "
                              "reward functions")
        if not names[0]:
            return None
        return {name: [v for _, done in sampled for v in done.rewards[name]] for name in names[0]}

    def _score(self, sampled: list[tuple[list[Any], Any]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """``rewards_per_func [N, F]`` of this rank's completions, and their records."""
        from titan_plugins.rewards.scoring import score

        G = self.objective.num_generations
        flat = [(row, ids) for rows, done in sampled for k, row in enumerate(rows)
                for ids in done.ids[k * G:(k + 1) * G]]
        completions = [self._decode(ids, row.conversational) for row, ids in flat]
        keys = list(flat[0][0].columns)
        columns = {k: [row.columns.get(k) for row, _ in flat] for k in keys}
        table = score(self.rewards, prompts=[row.prompt for row, _ in flat], completions=completions,
                      completion_ids=[ids for _, ids in flat], columns=columns, wheres=[row.where for row, _ in flat],
                      given=self._given(sampled))
        records = [{"prompt": row.prompt, "position": row.position, "completion": c, "completion_ids": ids}
                   for (row, ids), c in zip(flat, completions, strict=True)]
        return torch.tensor(table, dtype=torch.float32).T.reshape(len(flat), len(self.rewards)), records

    def _cp_width(self, run: JobView, rows: list[tuple[list[list[int]], list[list[int]]]]) -> int | None:
        """Under context parallel every microbatch of the step is one row length that
        splits into ``2 cp`` chunks: the longest, rounded up (at most ``training.seq_len``,
        which splits); else None (each microbatch its own longest, as TRL pads)."""
        from titan_plugins.distributed.context_parallel import context_parallel

        cp = context_parallel(getattr(run, "dims", None))
        if cp is None:
            return None
        chunks = 2 * cp.size
        longest = max(row_width(prompts, completions) for prompts, completions in rows)
        return -(-longest // chunks) * chunks

    def _old_logps(self, run: JobView, batch: RolloutBatch) -> torch.Tensor:
        from titan_plugins.distributed.forward_only import moe_counters_kept, resharded
        from titan_plugins.loss.token_logps import token_logps

        parts = run.model.parts
        with torch.no_grad(), run.loss_context(), moe_counters_kept(parts), resharded(parts):
            out = parts[0](batch[0].to(run.device))
            return token_logps(out, batch[1].to(run.device), self.objective.temperature)[0]

    # ------------------------------------------------------------------ the stage
    def generate(self, run: JobView, step: int, batches: list[Any]) -> tuple[list[RolloutBatch], dict[str, float]]:
        objective, G = self.objective, self.objective.num_generations
        t0 = time.perf_counter()
        sampled = self._sample(run, step, batches)
        t1 = time.perf_counter()
        rewards_per_func, records = self._score(sampled)
        t2 = time.perf_counter()
        ids = [r["completion_ids"] for r in records]
        lengths = torch.tensor([len(c) for c in ids], dtype=torch.float32)
        truncated = torch.tensor([is_truncated(c, self.stops) for c in ids])
        local = torch.cat([rewards_per_func, lengths[:, None], truncated[:, None].float()], dim=1)
        table, rank = _gather(run, local.to(run.device))
        table = table.cpu()
        F = len(self.rewards)
        adv, rewards, zero_std = advantages(table[:, :F], self.weights, G, objective.scale_rewards)
        metrics = rollout_metrics([n for n, _ in self.rewards], table[:, :F], rewards, zero_std, table[:, F],
                                  table[:, F + 1].bool())
        n_local = local.shape[0]
        adv_local = adv[rank * n_local:(rank + 1) * n_local]
        out, offset = [], 0
        rows_of = [([row.ids for row in rows for _ in range(G)], done.ids) for rows, done in sampled]
        width = self._cp_width(run, rows_of)
        for prompts, ids in rows_of:
            n = len(ids)
            masked = [objective.mask_truncated_completions and bool(t) for t in truncated[offset:offset + n]]
            inputs, labels = training_rows(prompts, ids, masked, self.pad_id, width)
            out.append(RolloutBatch(inputs, labels, adv_local[offset:offset + n].clone()))
            offset += n
        if objective.num_iterations > 1:  # the sampling policy's log-probs, kept for the cycle's steps
            for batch in out:
                batch.old_logps = self._old_logps(run, batch)
        metrics["time/generation_s"] = t1 - t0
        metrics["time/scoring_s"] = t2 - t1
        self._log(run, step, records, rewards_per_func, adv_local, truncated)
        return out, metrics

    def _log(self, run: JobView, step: int, records: list[dict[str, Any]], rewards_per_func: torch.Tensor,
             adv: torch.Tensor, truncated: torch.Tensor) -> None:
        names = [n for n, _ in self.rewards]
        weights = self.weights.tolist()
        for k, record in enumerate(records):
            values = rewards_per_func[k].tolist()
            record["step"] = step
            record["rewards"] = {n: (None if v != v else v) for n, v in zip(names, values, strict=True)}
            scored = [w * v for w, v in zip(weights, values, strict=True) if v == v]
            record["reward"] = sum(scored) if scored else None
            record["advantage"] = float(adv[k])
            record["truncated"] = bool(truncated[k])
            record["length"] = len(record.pop("completion_ids"))
        everyone = [records]
        if run.dp_group is not None:
            everyone = [None] * dist.get_world_size(run.dp_group)
            dist.all_gather_object(everyone, records, group=run.dp_group)
        if run.rank == 0:
            ordered = [{"step": r["step"], **{k: v for k, v in r.items() if k != "step"}}
                       for part in everyone for r in part]
            write_completions(run.run_dir, ordered)
