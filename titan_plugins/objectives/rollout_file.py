"""``rollout=file``: completions replayed from ``rollout.path`` instead of sampled, for
tests, for debugging a run and for comparing with another trainer (feed TRL's
GRPOTrainer the same through its ``rollout_func``).

One JSON object per line, one line per prompt::

    {"step": 1, "position": 0, "completion_ids": [[...], [...]], "rewards": {"accuracy": [1.0, 0.0]}}

``completion_ids`` holds the prompt's ``num_generations`` completions (token ids, the EOS
included where the completion ended with one); ``rewards`` (optional) the values of some
reward functions by name, used instead of calling them (``null`` skips, as a function's
None). A line names its prompt by ``position`` (its global position in the run's order,
which ``completions.jsonl`` records) or by ``prompt`` (as the data file holds it); ``step``
is optional (a line without one serves any step). A prompt of the run that no line
names stops the run in one line.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_plugins.errors import ConfigError
from titan_plugins.objectives.rollout import Completions

if TYPE_CHECKING:
    from titan_plugins.data.prompt_source import PromptRow
    from titan_plugins.objectives.job import JobView

__all__ = ["FileRollout"]


def _key(step: Any, how: str, value: Any) -> tuple:
    return (None if step is None else int(step), how, json.dumps(value, sort_keys=True))


class FileRollout:
    """The engine of ``rollout=file`` (module docstring)."""

    name = "file"

    def __init__(self, job: Any, objective: Any) -> None:
        path = job.rollout.get("path") if hasattr(job.rollout, "get") else getattr(job.rollout, "path", None)
        if not path:
            raise ConfigError("rollout=file needs rollout.path=FILE (a JSONL of completions)")
        self.path = Path(str(path)).expanduser()
        if not self.path.is_file():
            raise ConfigError(f"rollout.path={path!r} does not exist")
        self.lines: dict[tuple, deque] = defaultdict(deque)
        for k, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{self.path}:{k}"
            try:
                entry = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(entry, dict) or "completion_ids" not in entry:
                raise ConfigError(f"{where}: a line needs 'completion_ids' (and 'position' or 'prompt')")
            if "position" in entry:
                key = _key(entry.get("step"), "position", int(entry["position"]))
            elif "prompt" in entry:
                key = _key(entry.get("step"), "prompt", entry["prompt"])
            else:
                raise ConfigError(f"{where}: a line names its prompt by 'position' or 'prompt'")
            self.lines[key].append((entry, where))

    def _entry(self, step: int, row: PromptRow) -> tuple[dict, str]:
        for key in (_key(step, "position", row.position), _key(step, "prompt", row.prompt),
                    _key(None, "position", row.position), _key(None, "prompt", row.prompt)):
            queue = self.lines.get(key)
            if queue:  # a step's lines are used once; a line without a step serves every step
                return queue.popleft() if key[0] is not None else queue[0]
        raise ConfigError(f"rollout.path={self.path}: no line for step {step}'s prompt at position {row.position} "
                          f"({row.where})")

    def complete(self, run: JobView, step: int, micro: int, rows: list[PromptRow],
                 num_generations: int) -> Completions:
        ids: list[list[int]] = []
        rewards: dict[str, list[Any]] = {}
        named: set[str] | None = None
        for row in rows:
            entry, where = self._entry(step, row)
            group = entry["completion_ids"]
            if (not isinstance(group, list) or len(group) != num_generations
                    or not all(isinstance(c, list) and c and all(isinstance(t, int) for t in c) for c in group)):
                raise ConfigError(f"{where}: 'completion_ids' must be {num_generations} non-empty lists of token "
                                  f"ids (objective.num_generations={num_generations})")
            ids.extend([list(c) for c in group])
            given = entry.get("rewards") or {}
            if named is not None and set(given) != named:
                raise ConfigError(f"{where}: rewards for {sorted(given)}, but another prompt of the batch gives them "
                                  f"for {sorted(named)} (every line of a step names the same rewards)")
            named = set(given)
            for name, values in given.items():
                if not isinstance(values, list) or len(values) != num_generations:
                    raise ConfigError(f"{where}: rewards.{name} must hold {num_generations} values")
                rewards.setdefault(name, []).extend(values)
        return Completions(ids, rewards or None)
