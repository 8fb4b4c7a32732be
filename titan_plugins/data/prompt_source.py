"""``data.name=prompts``: TRL's prompt-only rows for online objectives (``objective=grpo``).

A row's ``prompt`` (``data.prompts.prompt_field``) is a list of messages
(conversational: rendered with the model's chat template and its generation prompt,
as TRL's GRPOTrainer renders it) or a string (plain: tokenized as transformers'
``tokenizer(text)``, what the tokenizer adds included). Every other column (an
``answer``, a ``solution``) is handed to the reward functions by name, one value per
completion, as TRL hands the dataset's columns over. Files: JSONL, Parquet (a file or a
folder of them) or a Hugging Face ``save_to_disk`` folder (``data.split``); without
``data.path``, the shipped arithmetic task (``assets/arithmetic.jsonl``: sums and
differences of two numbers below 30 with their exact ``answer``).

Batches: ``training.local_batch_size`` prompts per microbatch (the objective samples
``num_generations`` completions of each). Step ``s`` trains on the prompts at positions
``[s P, (s+1) P)`` of the shuffled order (``P`` prompts per global batch, reshuffled
with ``training.seed`` each epoch), dealt to the data-parallel ranks and accumulation
microbatches as ``data.name=preference`` deals pairs: the global batch does not depend
on the layout, and the state is one integer, so resume is exact. A sample's tensors are
the prompt's ids right-padded to ``training.seq_len`` (labels all ignored: a prompt
trains nothing until its completions exist); what the rollout needs rides along as the
sample's ``row`` (:class:`PromptRow`), which the loader hands over as ``Batch.rows``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX

__all__ = ["PromptDataset", "PromptRow", "build_prompts", "check_prompts", "encode_prompt_row", "prompt_of",
           "prompts_path"]


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    value = getattr(obj, key, default)
    return default if value is None else value


def prompts_path(data_config: Any) -> str:
    """``data.path``, else the shipped arithmetic task."""
    from titan_plugins.data.chat_source import ASSETS

    return str(_get(data_config, "path") or ASSETS / "arithmetic.jsonl")


def _field(data_config: Any) -> str:
    return str(_get(_get(data_config, "prompts") or {}, "prompt_field", "prompt"))


@dataclass
class PromptRow:
    """One prompt as the rollout reads it: the ``prompt`` as the file holds it (messages
    or a string, what the rewards see), the other ``columns``, the prompt's token ``ids``,
    ``where`` it came from (file and row) and its global ``position`` in the run's order
    (which seeds its sampling: the same at any layout and after a resume)."""

    prompt: Any
    columns: dict[str, Any]
    ids: list[int]
    where: str
    position: int
    conversational: bool = field(default=False)


def prompt_of(row: Mapping, prompt_field: str, where: str) -> tuple[Any, dict[str, Any], bool]:
    """``(prompt, other columns, conversational)`` of a row, or one line naming the row."""
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: a row must be an object with a {prompt_field!r} field")
    prompt = row.get(prompt_field)
    columns = {k: v for k, v in row.items() if k != prompt_field}
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: field {prompt_field!r} is empty")
        return prompt, columns, False
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise ConfigError(f"{where}: field {prompt_field!r}: a message needs 'role' and 'content'")
        return [dict(m) for m in prompt], columns, True
    raise ConfigError(f"{where}: field {prompt_field!r} must be a string or a non-empty list of messages "
                      f"(TRL's prompt-only format)")


def encode_prompt_row(prompt: Any, conversational: bool, template: Any, tokenizer: Any) -> list[int]:
    """The prompt's ids: the chat template's render with the generation prompt, or the
    text as transformers' ``tokenizer(text)`` encodes it."""
    if conversational:
        from titan_plugins.chat.encode import encode_prompt

        return encode_prompt(prompt, template, tokenizer)
    return list(tokenizer.encode_text(prompt))


class _Sample(tuple):
    row: PromptRow


class PromptDataset:
    """The prompts in the run's order (module docstring); ``block`` (prompts per batch)
    and ``set_layout`` are set by the loader."""

    def __init__(self, data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
                 seed: int) -> None:
        from titan_plugins.data.preference_source import read_pairs

        self.path = prompts_path(data_config)
        self.rows = read_pairs(self.path, _get(data_config, "split", "train"))
        if not self.rows:
            raise ConfigError(f"data.path={self.path!r} holds no rows")
        self.prompt_field = _field(data_config)
        self.template_spec = _get(_get(data_config, "prompts") or {}, "template")
        self.tokenizer_dir = _get(data_config, "tokenizer")
        self._template: Any = None
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.pad_id = tokenizer.pad_id if getattr(tokenizer, "pad_id", -1) >= 0 else 0
        self.block, self.accum = 1, 1
        self.batches = 0  # batches handed out: the whole state
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        self.block, self.accum = local_batch_size, grad_accum_steps

    def template(self) -> Any:
        if self._template is None:
            from titan_plugins.chat.template import load_chat_template
            from titan_plugins.data.chat_source import CHAT_TOKENIZER

            self._template = load_chat_template(self.template_spec, self.tokenizer_dir or str(CHAT_TOKENIZER),
                                                key="data.prompts.template")
        return self._template

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=g).tolist()}
        return self._orders[epoch]

    def _positions(self, k: int) -> range:
        """The global prompt positions of this rank's batch ``k``."""
        step, micro = divmod(k, self.accum)
        start = step * self.block * self.dp_world * self.accum + (micro * self.dp_world + self.dp_rank) * self.block
        return range(start, start + self.block)

    def prompt_row(self, position: int) -> PromptRow:
        epoch, i = divmod(position, len(self.rows))
        row, where = self.rows[self._order(epoch)[i]]
        prompt, columns, conversational = prompt_of(row, self.prompt_field, where)
        ids = encode_prompt_row(prompt, conversational, self.template() if conversational else None, self.tokenizer)
        if not ids or len(ids) >= self.seq_len:
            raise ConfigError(f"{where}: the prompt is {len(ids)} tokens, which leaves no room for a completion "
                              f"in training.seq_len={self.seq_len}")
        return PromptRow(prompt, columns, ids, where, position, conversational)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            positions = self._positions(self.batches)
            self.batches += 1
            for position in positions:
                row = self.prompt_row(position)
                pad = self.seq_len - len(row.ids)
                sample = _Sample((torch.tensor(row.ids + [self.pad_id] * pad, dtype=torch.int64),
                                  torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)))
                sample.row = row
                yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches = int(state["batches"])


def build_prompts(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
                  seed: int) -> PromptDataset:
    """The ``data.name=prompts`` builder (the DatasetSpec contract)."""
    return PromptDataset(data_config, tokenizer, dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len, seed=seed)


def check_prompts(data_config: Any) -> None:
    """Before launch: the file reads, every row is a prompt-only row (one line naming the
    file and row), and the first rows render (the chat template exists where needed)."""
    from titan_plugins.data.preference_source import read_pairs

    path = prompts_path(data_config)
    rows = read_pairs(path, _get(data_config, "split", "train"))
    if not rows:
        raise ConfigError(f"data.path={path!r} holds no rows")
    prompt_field = _field(data_config)
    for row, where in rows:
        prompt_of(row, prompt_field, where)
    from titan_plugins.data.tokenizer import build_tokenizer

    dataset = PromptDataset(data_config, build_tokenizer(data_config), dp_rank=0, dp_world=1, seq_len=1 << 30,
                            seed=0)
    for position in range(min(4, len(rows))):
        dataset.prompt_row(position)
