"""Tiny tokenizer folders laid out like five released model families (tests only).

Each folder has a byte-level BPE ``tokenizer.json`` trained here on a few sentences,
the family's special tokens and post-processor, and the ``tokenizer_config.json`` /
``config.json`` / ``generation_config.json`` special-token fields of the released
folders (nothing is downloaded):

- ``qwen3``: no BOS (``bos_token: null``) although config.json names 151643's
  counterpart ``<|endoftext|>``; a ``ByteLevel`` post-processor.
- ``llama3`` (Llama 3.1 Instruct): BOS from the post-processor, EOS ``<|eot_id|>``,
  config.json's ``eos_token_id`` a list of three, no pad token.
- ``gemma``, ``deepseek_v3``: ``add_bos_token: true``, the post-processor adds BOS.

Qwen3's and Gemma's folders name ``PreTrainedTokenizerFast``: transformers 5's
``Qwen2Tokenizer`` / ``GemmaTokenizer`` rebuild their family's pre-tokenizer (Qwen2's
digit-splitting regex, Gemma's SentencePiece pipeline) around the vocabulary, which this
byte-level test vocabulary does not follow; the special-token fields are the families'.
- ``mistral``: ``add_bos_token: true``, ``add_eos_token: false``.
- ``phi3`` (Phi-3.5-mini-instruct): ``add_bos_token: false``, a BOS that is not added.
"""

from __future__ import annotations

import json
from pathlib import Path


def _added(content: str) -> dict:  # tokenizer_config.json's AddedToken form (DeepSeek-V3's)
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
            "rstrip": False, "single_word": False}


_TEXT = [
    "Hello world, this is a test of the tokenizer.",
    "What is the capital of France? The capital of France is Paris.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Waves fold into foam, the tide keeps its slow time. 12 * 7 = 84.",
] * 4

LAYOUTS: dict[str, dict] = {
    "qwen3": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos_pp": None,
        "tokenizer_config": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "config": {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"},
        "generation": {"bos_token_id": "<|endoftext|>", "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                       "pad_token_id": "<|endoftext|>"},
        "expect": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "adds": []},
    },
    "llama3": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eom_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"],
        "bos_pp": "<|begin_of_text|>",
        "tokenizer_config": {"tokenizer_class": "PreTrainedTokenizerFast",
                             "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "config": {"bos_token_id": "<|begin_of_text|>",
                   "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]},
        "generation": {"bos_token_id": "<|begin_of_text|>",
                       "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]},
        "expect": {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
                   "adds": ["<|begin_of_text|>"]},
    },
    "gemma": {
        "special": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "bos_pp": "<bos>",
        "tokenizer_config": {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
                             "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
                             "pad_token": "<pad>", "unk_token": "<unk>"},
        "config": {"bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"],
                   "pad_token_id": "<pad>"},
        "generation": {"bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"],
                       "pad_token_id": "<pad>"},
        "expect": {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "adds": ["<bos>"]},
    },
    "deepseek_v3": {
        "special": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        "bos_pp": "<｜begin▁of▁sentence｜>",
        "tokenizer_config": {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True,
                             "add_eos_token": False, "bos_token": _added("<｜begin▁of▁sentence｜>"),
                             "eos_token": _added("<｜end▁of▁sentence｜>"),
                             "pad_token": _added("<｜end▁of▁sentence｜>")},
        "config": {"bos_token_id": "<｜begin▁of▁sentence｜>", "eos_token_id": "<｜end▁of▁sentence｜>"},
        "generation": {"bos_token_id": "<｜begin▁of▁sentence｜>", "eos_token_id": "<｜end▁of▁sentence｜>"},
        "expect": {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
                   "pad": "<｜end▁of▁sentence｜>", "adds": ["<｜begin▁of▁sentence｜>"]},
    },
    "phi3": {  # Phi-3.5-mini-instruct: add_bos_token false, EOS <|endoftext|>
        "special": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>",
                    "<|user|>"], "bos_pp": None,
        "tokenizer_config": {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
                             "add_eos_token": False, "bos_token": "<s>", "eos_token": "<|endoftext|>",
                             "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
        "config": {"bos_token_id": "<s>", "eos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>"},
        "generation": {"bos_token_id": "<s>", "eos_token_id": ["<|endoftext|>", "<|end|>"],
                       "pad_token_id": "<|endoftext|>"},
        "expect": {"bos": "<s>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "adds": []},
    },
    "mistral": {
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "bos_pp": "<s>",
        "tokenizer_config": {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                             "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                             "unk_token": "<unk>"},
        "config": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
        "generation": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
        "expect": {"bos": "<s>", "eos": "</s>", "pad": None, "adds": ["<s>"]},
    },
}


def tokenizer_json(layout: str, extra_special: list[str] | None = None) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = LAYOUTS[layout]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_TEXT, trainer=trainer)
    tok.add_special_tokens([*spec["special"], *(extra_special or [])])
    bos = spec["bos_pp"]
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def _ids(tok, value):
    if isinstance(value, list):
        return [tok.token_to_id(v) for v in value]
    return tok.token_to_id(value) if isinstance(value, str) else value


def make_layout(root: Path, layout: str, *, extra_special: list[str] | None = None,
                tokenizer_config: dict | None = None, template: str | None = None) -> Path:
    """The folder of ``layout`` under ``root``; ``tokenizer_config`` replaces fields,
    ``template`` becomes its ``chat_template``."""
    from tokenizers import Tokenizer

    spec = LAYOUTS[layout]
    folder = Path(root) / layout
    folder.mkdir(parents=True, exist_ok=True)
    text = tokenizer_json(layout, extra_special)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = Tokenizer.from_str(text)
    config = {**spec["tokenizer_config"], "model_max_length": 4096, **(tokenizer_config or {})}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    for name, key in (("config.json", "config"), ("generation_config.json", "generation")):
        (folder / name).write_text(json.dumps({k: _ids(tok, v) for k, v in spec[key].items()}, indent=2))
    return folder
