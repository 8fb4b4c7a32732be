"""Special-token ids come from the tokenizer in use, not from a flavor's table.

A model config with an ``eos_id`` field (the document separator of a ``block_causal``
mask; Qwen3, Llama 3/4 and any plugin that follows them) gets the tokenizer's EOS id
at launch unless the user set ``model.eos_id`` or ``model.hf``'s config.json states
it: a debug flavor's ``eos_id=151645`` beside a 2048-token vocabulary would separate no
document. A ``block_causal`` mask that cannot take effect is one error line before
launch, for every model: an ``eos_id`` outside the vocabulary, or a special token that is
not the tokenizer's EOS (text never encodes to it, and the packer ends documents with
EOS). An ordinary token stated as ``model.eos_id`` (a newline, say) is a separator the
user chose: it occurs in the text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from titan_plugins.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from titan_plugins.spec import ModelSpec

__all__ = ["check_attention_mask", "hand_document_mask", "hand_special_tokens"]

_BLOCK_CAUSAL = "block_causal"


def _tokenizer(data: Any) -> Any:
    from titan_plugins.data.tokenizer import build_tokenizer

    return build_tokenizer(data)


def _tokenizer_name(data: Any) -> str:
    return f"data.tokenizer={data.tokenizer}" if data.get("tokenizer") else "the shipped tokenizer"


def _stated(spec: ModelSpec, job: DictConfig, model_node: DictConfig, key: str) -> bool:
    """Whether the user (an override) or config.json of ``model.hf`` gave ``model.<key>``."""
    if key in model_node and not OmegaConf.is_missing(model_node, key):
        return True
    if job.model.get("hf"):
        from titan_plugins.hf.config import hf_model_values

        return key in hf_model_values(spec, job.model.hf)
    return False


_CHAT_SOURCES = ("chat", "chat_sample")


def _packs_conversations(data: Any) -> bool:
    """Whether the data packs several conversations per row (a chat source, or a mix
    holding one, with ``data.chat.pack``)."""
    chat = data.get("chat")
    if chat is None or not chat.get("pack", True):
        return False
    if data.get("name") in _CHAT_SOURCES:
        return True
    return data.get("name") == "mix" and any(e.get("name") in _CHAT_SOURCES for e in data.get("mix") or [])


def hand_document_mask(spec: ModelSpec, job: DictConfig, model_node: DictConfig) -> str | None:
    """Packed conversations must not attend to each other: where the model has
    ``attn_mask`` and nobody stated it, it becomes ``block_causal`` (documents come from
    the rows' document ids); a stated ``causal`` is one error line; a model without the
    option trains on padded rows (``data.chat.pack=false``). Returns the note to print, if any."""
    if not _packs_conversations(job.data):
        return None
    if "attn_mask" not in job.model:
        job.data.chat.pack = False
        return (f"note: model {spec.name!r} has no document mask (model.attn_mask), so packed "
                "conversations would attend to each other: rows are padded, one conversation "
                "each (data.chat.pack=false)")
    if not _stated(spec, job, model_node, "attn_mask"):
        job.model.attn_mask = _BLOCK_CAUSAL
        return None
    if str(getattr(job.model.attn_mask, "value", job.model.attn_mask)) != _BLOCK_CAUSAL:
        raise ConfigError(
            f"model.attn_mask={job.model.attn_mask}: data.chat.pack=true puts several conversations "
            "in a row, which would attend to each other; use model.attn_mask=block_causal or "
            "data.chat.pack=false"
        )
    return None


def _listed_eos(job: DictConfig) -> list[int] | None:
    """config.json's ``eos_token_id`` of ``model.hf`` where it is a list (Llama 3.1
    Instruct: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``), else None."""
    if not job.model.get("hf"):
        return None
    from titan_plugins.hf.config import read_hf_config

    value = read_hf_config(job.model.hf).get("eos_token_id")
    return [int(v) for v in value] if isinstance(value, list) and value else None


def _end_of_turn(job: DictConfig, tokenizer: Any) -> int | None:
    """The id the chat template ends an assistant turn with (chat data only)."""
    if job.data.get("name") not in _CHAT_SOURCES:
        return None
    from titan_plugins.chat.encode import end_of_turn_ids
    from titan_plugins.chat.prompting import template_for

    try:
        ids = end_of_turn_ids(template_for(job.data, None), tokenizer)
    except ConfigError:
        return None  # no template: the chat source names the problem at launch
    return ids[-1] if ids else None


def hand_special_tokens(spec: ModelSpec, job: DictConfig, model_node: DictConfig) -> None:
    """Set ``job.model.eos_id`` to the tokenizer's EOS id where the model has the field
    and nobody stated it. ``model_node``: the composed model node before resolution
    (its unset fields are ``???``). Where config.json lists several EOS ids and the user
    did not set ``model.eos_id``, the one the tokenizer ends a text with (its EOS) or the
    chat template ends a turn with is taken, if listed: config.json's first id
    (``<|end_of_text|>``) ends no Llama 3.1 Instruct conversation."""
    if "eos_id" not in job.model:
        return
    if job.data.get("name") == "synthetic" and job.data.get("vocab_size"):
        return  # random ids of another vocabulary: no tokenizer is in use
    user = "eos_id" in model_node and not OmegaConf.is_missing(model_node, "eos_id")
    listed = None if user else _listed_eos(job)
    if listed is not None:
        tok = _tokenizer(job.data)
        for candidate in (tok.eos_id, _end_of_turn(job, tok)):
            if candidate in listed:
                job.model.eos_id = int(candidate)
                return
        return
    if _stated(spec, job, model_node, "eos_id"):
        return
    eos = _tokenizer(job.data).eos_id
    if eos >= 0:
        job.model.eos_id = eos
    elif str(job.model.get("attn_mask")) == _BLOCK_CAUSAL:  # the flavor's id means nothing here
        raise ConfigError(
            f"model.attn_mask=block_causal needs an end-of-document token, but {_tokenizer_name(job.data)} "
            "has no EOS token (use model.attn_mask=causal, or name the separator: model.eos_id=ID)"
        )


def check_attention_mask(model_config: Any, data: DictConfig) -> None:
    """A ``block_causal`` mask must find its documents: the model's ``eos_id`` is inside
    the vocabulary and the tokenizer's EOS id, or an ordinary token (a separator the user
    named), never another special token. Raises ConfigError in one line."""
    mask = getattr(model_config, "attn_mask", None)
    if getattr(mask, "value", mask) != _BLOCK_CAUSAL:
        return
    eos_id = getattr(model_config, "eos_id", None)
    if not isinstance(eos_id, int):
        return  # the model finds documents some other way
    vocab = getattr(model_config, "vocab_size", None)
    if isinstance(vocab, int) and not 0 <= eos_id < vocab:
        raise ConfigError(
            f"model.attn_mask=block_causal: model.eos_id={eos_id} is outside the vocabulary "
            f"[0, model.vocab_size={vocab}), so no document would be separated"
        )
    if data.get("name") == "synthetic" and data.get("vocab_size"):
        return
    tok = _tokenizer(data)
    if eos_id == tok.eos_id:
        return
    name = _tokenizer_name(data)
    if eos_id >= tok.vocab_size:
        raise ConfigError(
            f"model.attn_mask=block_causal: model.eos_id={eos_id} is no token of {name} "
            f"({tok.vocab_size} ids; its EOS is {tok.eos_id}), so no document would be separated"
        )
    special = tok.special_name(eos_id)
    if special is not None:  # text never encodes to it; the packer ends documents with EOS
        raise ConfigError(
            f"model.attn_mask=block_causal: model.eos_id={eos_id} is {special}, not the EOS id of "
            f"{name} ({tok.eos_id}): documents end with EOS, so none would be separated "
            f"(drop the model.eos_id override or set model.eos_id={tok.eos_id})"
        )
    # An ordinary token the user chose as the separator (e.g. a newline): it is in the text.
