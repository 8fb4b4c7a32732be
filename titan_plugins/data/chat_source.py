"""``data.name=chat``: conversations from JSONL, Parquet or a local Hugging Face dataset
(``save_to_disk`` folder), rendered with the model's chat template, streamed.

Each row goes through ``titan_plugins.chat.formats.to_messages`` (``data.chat.format``:
messages, ShareGPT, instruction or prompt/completion columns) and
``titan_plugins.chat.encode.encode_conversation`` (the template of
``data.chat.template``, else the tokenizer folder's; ``data.chat.train_on``) into token
ids and a loss mask. A conversation of ``L`` tokens is ``L - 1`` positions: inputs
``ids[:-1]``, labels ``ids[1:]`` with ``IGNORE_INDEX`` where the mask says the token is
not a target; its last position never predicts the next conversation.

Rows of ``training.seq_len`` positions:

- ``data.chat.pack=true`` (default): conversations in order, greedily, as many as fit
  (one that does not fit starts the next row; the rest of the row is padding, label
  ``IGNORE_INDEX``). Each row carries per-position document ids (the conversation's index
  in the row, padding its own), which the trainer hands to the model's ``block_causal``
  mask (``attention_masks.documents``): a conversation attends to itself only.
- ``data.chat.pack=false``: one conversation per row, padded (plain causal attention).

Conversations longer than ``seq_len`` positions: ``data.chat.overlong=truncate``
(default) keeps the first ``seq_len`` positions, ``drop`` skips the conversation. A
conversation with no assistant turn, or with no target left after truncation, is
skipped. All of these are counted (``stats``: ``conversations``, ``truncated``,
``dropped``, ``no_assistant``, ``no_target``) and the run summary reports them.

Streaming, sharding and resume are the streaming sources' (``streaming.StreamingTokenDataset``):
units from metadata, one stream per row of the global batch, the state a few integers,
the pending row and the counts per stream; a resume re-reads one batch of rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from titan_plugins.data.streaming import StreamingTokenDataset, fresh_stream_state
from titan_plugins.data.units import (
    Unit,
    cfg_get,
    decode_line,
    open_hf,
    plan_units,
    record_file_kind,
    source_files,
    unit_lines,
)
from titan_plugins.errors import ConfigError
from titan_plugins.loss.token_loss import IGNORE_INDEX

__all__ = ["ChatDataset", "build_chat", "chat_kind", "check_chat_source"]

OVERLONG = ("truncate", "drop")
STATS = ("conversations", "truncated", "dropped", "no_assistant", "no_target")


def chat_kind(path: str | None) -> str:
    """``hf`` for a ``save_to_disk`` folder, else ``parquet`` or ``jsonl`` by the files."""
    return record_file_kind(path, "chat")


def _chat_settings(data_config: Any) -> dict[str, Any]:
    """The picklable ``data.chat`` settings and the tokenizer folder."""
    chat = cfg_get(data_config, "chat") or {}
    if hasattr(chat, "items") and not isinstance(chat, dict):  # a DictConfig
        from omegaconf import OmegaConf

        chat = OmegaConf.to_container(chat, resolve=True)
    elif not isinstance(chat, Mapping):
        chat = dict(vars(chat))
    settings = dict(chat)
    overlong = settings.get("overlong") or "truncate"
    if overlong not in OVERLONG:
        raise ConfigError(f"data.chat.overlong={overlong!r}: expected one of {', '.join(OVERLONG)}")
    settings["overlong"] = overlong
    settings["pack"] = bool(settings.get("pack", True))
    settings["train_on"] = settings.get("train_on") or "assistant"
    settings["tokenizer_dir"] = cfg_get(data_config, "tokenizer") or str(CHAT_TOKENIZER)
    return settings


def read_rows(kind: str, unit: Unit, hf_ds: Any = None) -> Iterator[tuple[Mapping, str]]:
    """The unit's rows as ``(row, where)``; ``where`` names the file and row for errors."""
    if kind == "jsonl":
        for k, line in unit_lines(unit):
            if not line.strip():
                continue
            where = f"{unit.path}:{k + 1}" if unit.start == 0 else f"{unit.path} (line {k + 1} after byte {unit.start})"
            try:
                row = json.loads(decode_line(line, unit))
            except ValueError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc})") from None
            yield row, where
    elif kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(unit.path).read_row_group(unit.start)
        for k, row in enumerate(table.to_pylist()):
            yield row, f"{unit.path} (row group {unit.start}, row {k})"
    else:  # hf
        for k, row in enumerate(hf_ds.select(range(unit.start, unit.stop))):
            yield row, f"{unit.path} (row {unit.start + k})"


class ChatDataset(StreamingTokenDataset):
    """Rows ``(input_ids, labels[, doc_ids])`` of rendered conversations (module docstring)."""

    BATCH = 32  # conversations rendered at a time (a resume re-renders at most these)

    def __init__(self, data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int,
                 num_workers: int, seq_len: int, seed: int, chat: Mapping[str, Any] | None = None) -> None:
        self.chat = dict(chat) if chat is not None else _chat_settings(data_config)
        kind = chat_kind(cfg_get(data_config, "path"))
        super().__init__(data_config, kind, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                         num_workers=num_workers, seq_len=seq_len, seed=seed)
        from titan_plugins.chat.formats import ChatFields

        self.fields = ChatFields.from_config(self.chat)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else 0
        self._template = None
        self.template()  # a missing or broken template fails here, before any row

    def template(self) -> Any:
        if self._template is None:
            from titan_plugins.chat.template import load_chat_template

            self._template = load_chat_template(self.chat.get("template"), self.chat["tokenizer_dir"])
        return self._template

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_template": None}  # compiled jinja: rebuilt per worker

    def identity(self) -> dict[str, Any]:
        keys = ("format", "template", "train_on", "pack", "overlong")
        return {**super().identity(), "chat": {k: self.chat.get(k) for k in keys}}

    def _fresh(self) -> dict[str, Any]:
        return {**fresh_stream_state(), "stats": dict.fromkeys(STATS, 0), "pending": dict.fromkeys(STATS, 0)}

    def _records(self, unit: Unit) -> Iterator[Any]:
        if self.kind == "hf" and self._hf is None:
            self._hf = open_hf(self.cfg.path, self.cfg.split)
        return read_rows(self.kind, unit, self._hf)

    # ----------------------------------------------------------- encoding
    def encode(self, row: Mapping, where: str) -> tuple[list[int], list[int]] | str:
        """``(inputs, labels)`` of one conversation, truncated per ``overlong``; or the
        name of the count it goes to when skipped."""
        from titan_plugins.chat.encode import encode_conversation
        from titan_plugins.chat.formats import NoAssistantTurn, to_messages

        try:
            messages = to_messages(row, self.fields, where=where)
        except NoAssistantTurn:
            return "no_assistant"
        tools = row.get("tools") if isinstance(row, Mapping) else None
        ids, mask = encode_conversation(messages, self.template(), self.tokenizer,
                                        train_on=self.chat["train_on"], tools=tools or None, where=where)
        inputs = ids[:-1]
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
        truncated = len(inputs) > self.seq_len
        if truncated:
            if self.chat["overlong"] == "drop":
                return "dropped"
            inputs, labels = inputs[: self.seq_len], labels[: self.seq_len]
        if all(t == IGNORE_INDEX for t in labels):
            return "no_target"
        return (inputs, labels, truncated)  # type: ignore[return-value]

    def _row(self, pieces: list[list[list[int]]]) -> tuple[torch.Tensor, ...]:
        n = self.seq_len
        inputs = [t for p in pieces for t in p[0]]
        labels = [t for p in pieces for t in p[1]]
        docs = [d for d, p in enumerate(pieces) for _ in p[0]]
        pad = n - len(inputs)
        inputs += [self.pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        docs += [len(pieces)] * pad
        row = (torch.tensor(inputs, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64))
        return (*row, torch.tensor(docs, dtype=torch.int64)) if self.chat["pack"] else row

    def _flush(self, st: dict[str, Any]) -> list[Any]:
        """A file of fewer conversations than fill one row: they make one padded row
        per epoch (chat rows pad), instead of a refusal."""
        pieces, st["carry"] = list(st["carry"]), []
        return [self._row(pieces)] if pieces else []

    def _pack(self, st: dict[str, Any], batch: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        pieces = list(st["carry"])
        stats = dict(st["stats"])
        rows, size = [], 0
        for row, where in batch:
            got = self.encode(row, where)
            if isinstance(got, str):
                stats[got] += 1
                continue
            inputs, labels, truncated = got
            size += len(inputs) + 1
            stats["conversations"] += 1
            stats["truncated"] += int(truncated)
            if not self.chat["pack"]:
                rows.append(self._row([[inputs, labels]]))
                continue
            if sum(len(p[0]) for p in pieces) + len(inputs) > self.seq_len:
                rows.append(self._row(pieces))
                pieces = []
            pieces.append([inputs, labels])
        st["pending"] = {k: stats[k] - st["stats"][k] for k in STATS}  # counted while handed out
        return rows, {"carry": pieces, "stats": stats, "pending": dict.fromkeys(STATS, 0)}, size


def build_chat(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int, seq_len: int,
               seed: int) -> ChatDataset:
    """The ``data.name=chat`` builder (the DatasetSpec contract)."""
    check_chat_source(data_config, tokenizer)
    return ChatDataset(data_config, tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                       num_workers=int(cfg_get(data_config, "num_workers", 0) or 0), seq_len=seq_len, seed=seed)


def check_chat_source(data_config: Any, tokenizer: Any = None, rows: int = 4, *, every_row: bool = False,
                      key: str = "data.path") -> None:
    """Before launch: the path, the template, and the first ``rows`` rows render (one line
    naming the row and the field where they do not). ``every_row`` (the launcher's check,
    not the ranks'): also a row that trains, read on until one does (``chat_trains.py``;
    ``key`` names the path in its message)."""
    settings = _chat_settings(data_config)
    from titan_plugins.chat.formats import ChatFields
    from titan_plugins.chat.template import load_chat_template

    ChatFields.from_config(settings)
    template = load_chat_template(settings.get("template"), settings["tokenizer_dir"])
    kind = chat_kind(cfg_get(data_config, "path"))
    from types import SimpleNamespace

    cfg = SimpleNamespace(path=cfg_get(data_config, "path"), split=cfg_get(data_config, "split", "train"))
    if kind != "hf":
        for f in source_files(cfg, kind):
            if f.stat().st_size == 0:
                raise ConfigError(f"data.path: {f} is empty")
    units = plan_units(cfg, kind, 1)
    if not units:
        raise ConfigError(f"data.path={cfg.path!r} holds no rows")
    if tokenizer is None:
        from titan_plugins.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(data_config)
    from titan_plugins.chat.encode import encode_conversation
    from titan_plugins.chat.formats import NoAssistantTurn, to_messages

    fields = ChatFields.from_config(settings)
    hf_ds = open_hf(cfg.path, cfg.split) if kind == "hf" else None
    for _, (row, where) in zip(range(rows), read_rows(kind, units[0], hf_ds)):
        try:
            messages = to_messages(row, fields, where=where)
        except NoAssistantTurn:
            continue
        encode_conversation(messages, template, tokenizer, train_on=settings["train_on"], where=where)
    if every_row:
        from titan_plugins.data.chat_trains import require_a_trained_row

        every = (pair for unit in units for pair in read_rows(kind, unit, hf_ds))
        require_a_trained_row(every, fields, template, tokenizer, settings["train_on"], key=f"{key}={cfg.path}")


# ------------------------------------------------------------------ shipped sample
ASSETS = Path(__file__).parent / "assets"
CHAT_TOKENIZER = ASSETS / "chat_tokenizer"  # the shipped tokenizer, specials renamed to ChatML's
CHAT_SAMPLE = ASSETS / "chat_sample.jsonl"  # synthetic conversations made by the project
CHAT_SAMPLE_SPLITS = {"train": CHAT_SAMPLE, "validation": ASSETS / "chat_sample_val.jsonl"}


def sample_config(data_config: Any) -> Any:
    """``data.name=chat_sample``: ``data.name=chat`` with the shipped sample as the default
    ``data.path`` (``data.split``: ``train``, or ``validation``, its held-out file) and the
    shipped ChatML tokenizer as the default ``data.tokenizer``."""
    from types import SimpleNamespace

    keys = ("split", "num_workers", "prefetch_factor", "chat")
    cfg = SimpleNamespace(**{k: cfg_get(data_config, k) for k in keys})
    cfg.name = "chat"
    split = cfg_get(data_config, "split", "train")
    if not cfg_get(data_config, "path") and split not in CHAT_SAMPLE_SPLITS:
        raise ConfigError(f"data.split={split!r}: the chat sample has the splits 'train' and 'validation'")
    cfg.path = cfg_get(data_config, "path") or str(CHAT_SAMPLE_SPLITS[split])
    cfg.tokenizer = cfg_get(data_config, "tokenizer") or str(CHAT_TOKENIZER)
    cfg.text_field = "text"
    return cfg


def build_chat_sample(data_config: Any, tokenizer: Any, *, dp_rank: int, dp_world: int,
                      seq_len: int, seed: int) -> ChatDataset:
    """The shipped chat sample (the DatasetSpec contract)."""
    return build_chat(sample_config(data_config), tokenizer, dp_rank=dp_rank, dp_world=dp_world,
                      seq_len=seq_len, seed=seed)
_CHATML_SPECIALS = {"<|bos|>": "<|im_start|>", "<|eos|>": "<|im_end|>"}


def make_chat_tokenizer(out_dir: str | Path, source: str | Path | None = None) -> Path:
    """A ChatML tokenizer folder made from the shipped ``tokenizer.json``: its two special
    tokens renamed ``<|im_start|>`` / ``<|im_end|>`` (ids 2046/2047, so the vocabulary and
    the debug models stay 2048), ``tokenizer_config.json`` naming ``<|im_end|>`` as EOS and
    padding and holding the shipped ChatML template. How ``assets/chat_tokenizer`` was made."""
    from titan_plugins.chat.template import TEMPLATES

    data = json.loads(Path(source or ASSETS / "tokenizer.json").read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        token["content"] = _CHATML_SPECIALS.get(token["content"], token["content"])
    vocab = data["model"]["vocab"]
    for old, new in _CHATML_SPECIALS.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "bos_token": None,
              "chat_template": (TEMPLATES / "chatml.jinja").read_text(encoding="utf-8")}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
