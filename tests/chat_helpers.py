"""Tiny tokenizer folders carrying the real Qwen3 and Llama 3.1 chat templates (tests only).

The templates are copied verbatim into tests/data/chat/. Each folder gets a byte-level BPE
``tokenizer.json`` trained here on a few sentences (a ~400-id vocabulary) plus the
model family's added tokens, and a ``tokenizer_config.json`` that transformers'
``PreTrainedTokenizerFast`` loads offline. The Llama folder's post-processor adds
``<|begin_of_text|>`` as the real one does, so a doubled BOS would show.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data" / "chat"

_TEXT = [
    "You are a helpful assistant. Answer briefly and clearly.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about the sea: waves fold into foam, the tide keeps its slow time.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Thinking step by step, 12 * 7 = 84. The answer is 84.",
    "Hello! How can I help you today? I'd like to learn about chat templates.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
]

FAMILIES = {
    "qwen3": {
        "template": "qwen3.jinja",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>"],
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "bos": None,
    },
    "llama3": {
        "template": "llama3_1.jinja",
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                    "<|finetune_right_pad_id|>"],
        "added": [],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                   "pad_token": "<|finetune_right_pad_id|>"},
        "bos": "<|begin_of_text|>",
    },
}


def template_text(family: str) -> str:
    return (DATA / FAMILIES[family]["template"]).read_text(encoding="utf-8")


def make_tokenizer_json(family: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(_TEXT * 3, trainer=trainer)
    tok.add_special_tokens(spec["special"])
    if spec["added"]:
        tok.add_tokens(spec["added"])
    if spec["bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


def make_folder(root: Path, family: str, *, where: str = "config") -> Path:
    """A tokenizer folder; the template sits in ``tokenizer_config.json`` (``where=config``),
    in ``chat_template.jinja`` (``jinja``), in the list form (``list``) or nowhere (``none``)."""
    folder = Path(root) / f"{family}-{where}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(make_tokenizer_json(family), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
              **FAMILIES[family]["config"]}
    text = template_text(family)
    if where == "config":
        config["chat_template"] = text
    elif where == "list":
        config["chat_template"] = [{"name": "default", "template": text},
                                   {"name": "tool_use", "template": text}]
    elif where == "jinja":
        (folder / "chat_template.jinja").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    "system_multi": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam,\nthe tide keeps its slow time."},
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "12 * 7 = 84."},
    ],
    "thinking": [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "<think>\n12 * 7 = 84\n</think>\n\nThe answer is 84."},
        {"role": "user", "content": "And 84 + 1?"},
        {"role": "assistant", "content": "85."},
    ],
    "tool": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "trailing_user": [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Thanks."},
    ],
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
