"""``data.name=preference``: TRL's preference rows, rendered with the model's chat
template (the code ``data.name=chat`` uses), as pairs of rows of one batch.

Row layouts (``data.preference.*_field`` name the columns):

- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` a list with
  one assistant message each (or one message, or its text);
- implicit prompt: ``chosen`` / ``rejected`` whole conversations; the prompt is their
  longest common prefix of messages, each completion the one assistant message after it;
- plain text: ``prompt`` a string (a user turn), ``chosen`` / ``rejected`` strings (the
  assistant's reply).

Files: JSONL, Parquet (a file or a folder of them) or a Hugging Face ``save_to_disk``
folder (``data.split``). A pair renders as ``prompt + completion`` through the template
and is split as TRL splits it: the prompt is the prompt's render with the generation
prompt, the completion every token after it (the reply, its end-of-turn token, what the
template writes after it); the loss counts only the completion's tokens.

Truncation (counted in the run summary): a prompt over ``max_prompt_length`` tokens
loses its start (``truncation_mode=keep_end``, TRL's prompt rule) or its end
(``keep_start``); a completion over ``max_completion_length`` loses its end; a pair
still over ``training.seq_len + 1`` tokens (``overlong``): ``truncate`` cuts its
completion's end, ``drop`` skips the pair, ``error`` stops before launch naming the row.

Batches: ``training.local_batch_size`` rows are ``n = local_batch_size / 2`` pairs, the
``n`` chosen rows first, then their ``n`` rejected rows (TRL's layout). Step ``s`` of the
run trains on the pairs at positions ``[s G, (s+1) G)`` of the shuffled order (``G``
pairs per global batch, reshuffled with ``training.seed`` each epoch), dealt to the
data-parallel ranks and accumulation microbatches: the global batch does not depend on
the layout. The state is one integer (batches handed out), so resume is exact. Every
rank reads the rows' text (a preference set is small next to a pre-training corpus) but
renders only the pairs it trains on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_plugins.data.units import record_file_kind
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX

__all__ = ["PreferenceDataset", "PreferenceSettings", "build_preference", "check_preference", "encode_pair",
           "read_pairs"]

TRUNCATION_MODES = ("keep_end", "keep_start")
OVERLONG = ("truncate", "drop", "error")
STATS = ("pairs", "prompt_truncated", "completion_truncated", "pairs_dropped")


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    value = getattr(obj, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class PreferenceSettings:
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    template: str | None = None
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str = "keep_end"
    overlong: str = "truncate"

    @classmethod
    def from_config(cls, data_config: Any) -> PreferenceSettings:
        pref = _get(data_config, "preference") or {}
        values = {k: _get(pref, k) for k in cls.__dataclass_fields__ if _get(pref, k) is not None}
        out = cls(**values)
        if out.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"data.preference.truncation_mode={out.truncation_mode}: expected one of "
                              f"{', '.join(TRUNCATION_MODES)}")
        if out.overlong not in OVERLONG:
            raise ConfigError(f"data.preference.overlong={out.overlong}: expected one of {', '.join(OVERLONG)}")
        return out


# ------------------------------------------------------------------ reading
def _kind(path: str | None) -> str:
    return record_file_kind(path, "preference")


def read_pairs(path: str, split: str = "train") -> list[tuple[Mapping, str]]:
    """Every row of ``path`` as ``(row, where)``; ``where`` names the file and row."""
    kind = _kind(path)
    p = Path(path).expanduser()
    rows: list[tuple[Mapping, str]] = []
    if kind == "hf":
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ConfigError(f"data.split={split!r}: {path} has the splits {', '.join(ds)}")
            ds = ds[split]
        return [(row, f"{path} (row {k})") for k, row in enumerate(ds)]
    files = sorted(p.rglob(f"*.{kind}")) if p.is_dir() else [p]
    for f in files:
        if kind == "jsonl":
            for k, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                try:
                    rows.append((json.loads(line), f"{f}:{k + 1}"))
                except ValueError as exc:
                    raise ConfigError(f"{f}:{k + 1}: not valid JSON ({exc})") from None
        else:
            import pyarrow.parquet as pq

            rows.extend((row, f"{f} (row {k})") for k, row in enumerate(pq.read_table(f).to_pylist()))
    return rows


# ------------------------------------------------------------------ one pair
def _messages(value: Any, role: str, field: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise ConfigError(f"{where}: field {field!r} must be a string or a list of messages")
    out = []
    for m in value:
        if "role" not in m or "content" not in m:
            raise ConfigError(f"{where}: field {field!r}: a message needs 'role' and 'content'")
        out.append({"role": str(m["role"]), "content": m["content"]})
    return out


def split_pair(row: Mapping, s: PreferenceSettings, where: str) -> tuple[list[dict], dict, dict]:
    """``(prompt messages, chosen message, rejected message)`` of a row, or a one-line
    ConfigError naming the row and the field."""
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: a row must be an object with {s.chosen_field!r} and {s.rejected_field!r}")
    for key in (s.chosen_field, s.rejected_field):
        if row.get(key) in (None, "", []):
            raise ConfigError(f"{where}: field {key!r} is missing or empty")
    chosen = _messages(row[s.chosen_field], "assistant", s.chosen_field, where)
    rejected = _messages(row[s.rejected_field], "assistant", s.rejected_field, where)
    if row.get(s.prompt_field) not in (None, "", []):
        prompt = _messages(row[s.prompt_field], "user", s.prompt_field, where)
    else:  # implicit prompt: the longest common prefix of the two conversations
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if not prompt:
            raise ConfigError(f"{where}: field {s.prompt_field!r} is missing and {s.chosen_field!r} / "
                              f"{s.rejected_field!r} share no prompt")
    for key, completion in ((s.chosen_field, chosen), (s.rejected_field, rejected)):
        if len(completion) != 1 or completion[0]["role"] != "assistant":
            raise ConfigError(f"{where}: field {key!r}: the completion must be one assistant message "
                              f"(got {len(completion)} message(s), roles {[m['role'] for m in completion]})")
        if not str(completion[0]["content"]).strip():
            raise ConfigError(f"{where}: field {key!r}: the completion is empty")
    if chosen[0]["content"] == rejected[0]["content"]:
        raise ConfigError(f"{where}: {s.chosen_field!r} and {s.rejected_field!r} are identical")
    return prompt, chosen[0], rejected[0]


def _encode(prompt: list[dict], completion: dict, template: Any, tokenizer: Any,
            where: str) -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids)`` as TRL splits a conversational pair: the prompt is
    the template's render of the prompt with the generation prompt (the assistant
    header), the completion every token of ``prompt + completion``'s render after it
    (the reply, its end-of-turn token and what the template writes after that)."""
    from titan_plugins.chat.encode import encode_conversation, encode_prompt

    prompt_ids = encode_prompt(prompt, template, tokenizer)
    ids, mask = encode_conversation([*prompt, completion], template, tokenizer, train_on="all", where=where)
    if ids[: len(prompt_ids)] == prompt_ids:
        return prompt_ids, ids[len(prompt_ids):]
    # A template that renders the prompt differently once a reply follows: the reply's
    # own tokens (the last assistant turn) are the completion.
    ids, mask = encode_conversation([*prompt, completion], template, tokenizer, train_on="last_assistant",
                                    where=where)
    start = mask.index(True) if True in mask else len(ids)
    return ids[:start], ids[start:]


def encode_pair(prompt: list[dict], chosen: dict, rejected: dict, template: Any, tokenizer: Any, *,
                settings: PreferenceSettings, seq_len: int, where: str) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Two rows ``(inputs, labels)`` of ``seq_len`` positions (chosen, rejected; labels
    only on the completion) and what was cut ``{"prompt": bool, "completion": bool}``;
    ``[]`` rows when the pair is dropped."""
    p_c, c = _encode(prompt, chosen, template, tokenizer, where)
    p_r, r = _encode(prompt, rejected, template, tokenizer, where)
    cut = {"prompt": False, "completion": False}
    out = []
    for p, comp in ((p_c, c), (p_r, r)):
        if settings.max_prompt_length and len(p) > settings.max_prompt_length:
            n = settings.max_prompt_length
            p = p[-n:] if settings.truncation_mode == "keep_end" else p[:n]
            cut["prompt"] = True
        if settings.max_completion_length and len(comp) > settings.max_completion_length:
            comp = comp[: settings.max_completion_length]
            cut["completion"] = True
        if len(p) + len(comp) > seq_len + 1:
            if settings.overlong == "error":
                raise ConfigError(f"{where}: the pair is {len(p) + len(comp)} tokens, over training.seq_len="
                                  f"{seq_len} + 1 (data.preference.overlong=error)")
            if settings.overlong == "drop" or len(p) >= seq_len:
                return [], cut  # nothing of the completion would be left to score
            comp = comp[: seq_len + 1 - len(p)]
            cut["completion"] = True
        ids = p + comp
        labels = [IGNORE_INDEX] * (len(p) - 1) + comp
        out.append((ids[:-1], labels))
    return out, cut


# ------------------------------------------------------------------ the dataset
class PreferenceDataset:
    """Rows of pairs in TRL's batch layout (module docstring); ``block`` (rows per batch)
    and ``set_layout`` are set by the loader."""

    def __init__(self, data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
                 seed: int) -> None:
        from titan_plugins.chat.template import load_chat_template
        from titan_plugins.data.chat_source import CHAT_TOKENIZER

        self.settings = PreferenceSettings.from_config(data_config)
        self.rows = read_pairs(_get(data_config, "path"), _get(data_config, "split", "train"))
        if not self.rows:
            raise ConfigError(f"data.path={_get(data_config, 'path')!r} holds no rows")
        self.template = load_chat_template(self.settings.template,
                                           _get(data_config, "tokenizer") or str(CHAT_TOKENIZER))
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.pad_id = tokenizer.pad_id if getattr(tokenizer, "pad_id", -1) >= 0 else 0
        self.block, self.accum = 2, 1
        self.batches = 0  # batches handed out: the whole state
        self.counts = dict.fromkeys(STATS, 0)
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """The pairs in the source (one epoch; objective.precompute_ref's first pass reads them all)."""
        return len(self.rows)

    def set_layout(self, local_batch_size: int, grad_accum_steps: int) -> None:
        if local_batch_size % 2:
            raise ConfigError(f"training.local_batch_size={local_batch_size} must be even with "
                              "data.name=preference (a chosen and a rejected row per pair)")
        self.block, self.accum = local_batch_size, grad_accum_steps

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=g).tolist()}
        return self._orders[epoch]

    def _positions(self, k: int) -> Iterator[int]:
        """The global pair positions of this rank's batch ``k``."""
        per = self.block // 2
        step, micro = divmod(k, self.accum)
        start = step * per * self.dp_world * self.accum + (micro * self.dp_world + self.dp_rank) * per
        return iter(range(start, start + per))

    def _pair(self, position: int) -> list[tuple[list[int], list[int]]]:
        """The two rows of the pair at ``position``; a dropped pair takes the next one."""
        n = len(self.rows)
        for attempt in range(n):
            pos = position + attempt * 7919  # a dropped pair: another one, the same on every layout
            epoch, i = divmod(pos, n)
            row, where = self.rows[self._order(epoch)[i]]
            prompt, chosen, rejected = split_pair(row, self.settings, where)
            rows, cut = encode_pair(prompt, chosen, rejected, self.template, self.tokenizer,
                                    settings=self.settings, seq_len=self.seq_len, where=where)
            if rows:
                self.counts["pairs"] += 1
                self.counts["prompt_truncated"] += int(cut["prompt"])
                self.counts["completion_truncated"] += int(cut["completion"])
                return rows
            self.counts["pairs_dropped"] += 1
        raise ConfigError(f"data.path: every pair is over training.seq_len={self.seq_len} (data.preference.overlong=drop)")

    def _tensor(self, inputs: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pad = self.seq_len - len(inputs)
        return (torch.tensor(inputs + [self.pad_id] * pad, dtype=torch.int64),
                torch.tensor(labels + [IGNORE_INDEX] * pad, dtype=torch.int64))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            pairs = [self._pair(pos) for pos in self._positions(self.batches)]
            self.batches += 1
            for side in (0, 1):  # the chosen rows, then the rejected rows
                for pair in pairs:
                    yield self._tensor(*pair[side])

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches = int(state["batches"])
        self.counts = dict(state.get("counts") or self.counts)


def build_preference(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
                     seed: int) -> PreferenceDataset:
    """The ``data.name=preference`` builder (the DatasetSpec contract)."""
    return PreferenceDataset(data_config, tokenizer, dp_rank=dp_rank, dp_world=dp_world, seq_len=seq_len,
                             seed=seed)


def check_preference(data_config: Any, seq_len: int | None = None) -> None:
    """Before launch: every row is a well-formed pair (one line naming the file and row);
    with ``overlong=error`` and ``seq_len``, every pair also fits."""
    settings = PreferenceSettings.from_config(data_config)
    rows = read_pairs(_get(data_config, "path"), _get(data_config, "split", "train"))
    if not rows:
        raise ConfigError(f"data.path={_get(data_config, 'path')!r} holds no rows")
    from titan_plugins.chat.template import load_chat_template
    from titan_plugins.data.chat_source import CHAT_TOKENIZER

    template = load_chat_template(settings.template, _get(data_config, "tokenizer") or str(CHAT_TOKENIZER))
    tokenizer = None
    for k, (row, where) in enumerate(rows):
        prompt, chosen, rejected = split_pair(row, settings, where)
        if k < 4 or (settings.overlong == "error" and seq_len):  # the template renders them
            if tokenizer is None:
                from titan_plugins.data.tokenizer import build_tokenizer

                tokenizer = build_tokenizer(data_config)
            encode_pair(prompt, chosen, rejected, template, tokenizer, settings=settings,
                        seq_len=seq_len or 1 << 30, where=where)


# ------------------------------------------------------------------ shipped sample
def _sample_paths() -> dict[str, Path]:
    from titan_plugins.data.chat_source import ASSETS

    return {"train": ASSETS / "preference_sample.jsonl", "validation": ASSETS / "preference_sample_val.jsonl"}


def sample_config(data_config: Any) -> Any:
    """``data.name=preference_sample``: ``data.name=preference`` with the shipped pairs as the
    default ``data.path`` (``data.split`` train or validation) and the shipped ChatML tokenizer."""
    from types import SimpleNamespace

    from titan_plugins.data.chat_source import CHAT_TOKENIZER

    split = _get(data_config, "split", "train")
    paths = _sample_paths()
    if not _get(data_config, "path") and split not in paths:
        raise ConfigError(f"data.split={split!r}: the preference sample has the splits 'train' and 'validation'")
    return SimpleNamespace(name="preference", path=_get(data_config, "path") or str(paths[split]), split=split,
                           tokenizer=_get(data_config, "tokenizer") or str(CHAT_TOKENIZER),
                           preference=_get(data_config, "preference"))


def build_preference_sample(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
                            seed: int) -> PreferenceDataset:
    return build_preference(sample_config(data_config), tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                            seq_len=seq_len, seed=seed)


def check_preference_sample(data_config: Any, seq_len: int | None = None) -> None:
    check_preference(sample_config(data_config), seq_len)
