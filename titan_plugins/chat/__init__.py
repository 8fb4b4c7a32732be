"""Chat data: rows -> messages -> the model's chat template -> token ids and a loss mask.

    from titan_plugins.chat import ChatFields, to_messages, load_chat_template, encode_conversation

    fields = ChatFields.from_config(cfg.data.chat)          # format, messages_field, ...
    messages = to_messages(row, fields, where="train.jsonl:17")
    template = load_chat_template(None, "qwen3-folder")     # the folder's own template
    ids, mask = encode_conversation(messages, template, tokenizer, train_on="assistant")

Modules, one job each:

- ``formats``: ``to_messages(row, fields, *, where) -> list[dict]`` reads the layouts
  ``messages`` (role/content), ShareGPT ``conversations`` (from/value),
  ``instruction``/``input``/``output`` and ``prompt``/``completion`` into OpenAI-style
  messages; ``ChatFields`` (``data.chat.format=auto|messages|sharegpt|instruction|
  prompt_completion``, ``data.chat.messages_field``, column names). A bad row is one
  ``ConfigError`` line ``FILE:ROW: FIELD: why``. A conversation without an assistant
  turn raises ``NoAssistantTurn`` (a ``ConfigError``), which the data source catches to
  skip the row and count it (``require_assistant=False``: a prompt). ``to_tools(row, *,
  where)``: the row's ``tools`` (a list, or a JSON string) for the template, or None.
- ``template``: ``ChatTemplate`` (``render(messages, *, add_generation_prompt=False,
  tools=None) -> str``, ``render_spans``, ``with_variables``, ``has_generation_tags``)
  rendered with jinja2 exactly as transformers' ``apply_chat_template`` does, and
  ``load_chat_template(spec, tokenizer_dir)``: spec None -> the folder's
  ``chat_template.jinja`` or ``tokenizer_config.json`` ``chat_template``; else a file or a
  name (the folder's named templates, then the shipped ``chatml``). No template at all is
  a one-line ``ConfigError``.
- ``encode``: ``encode_conversation(messages, template, tokenizer, *, train_on="assistant",
  tools=None, where="") -> (ids, mask)``; ids equal
  ``AutoTokenizer.apply_chat_template(messages, tokenize=True)``; ``mask[i]``: token ``i``
  counts in the loss. ``train_on``: ``assistant`` (every assistant turn, through its
  end-of-turn token), ``last_assistant``, ``all``. Also ``encode_prompt`` (the
  conversation plus the assistant header, for generation), ``end_of_turn_ids`` (the
  tokens that close an assistant turn: stop tokens) and ``assistant_spans``.
- ``prompting``: a conversation as a generation prompt (``titan-generate --chat TEXT`` /
  ``--messages FILE``): ``read_messages``, ``template_for`` (the run's template),
  ``chat_prompt`` (ids and the stop id).
- ``make_sample``: writes the shipped synthetic sample
  ``titan_plugins/data/assets/chat_sample.jsonl`` (and ``chat_sample_val.jsonl``).

The ``Tokenizer`` is ``titan_plugins.data.tokenizer.Tokenizer`` (or a bare
``tokenizers.Tokenizer``); ``ChatTemplate`` pickles (it recompiles on load).
"""

from titan_plugins.chat.encode import (
    TRAIN_ON,
    assistant_spans,
    encode_conversation,
    encode_prompt,
    end_of_turn_ids,
)
from titan_plugins.chat.formats import (
    FORMATS,
    ROLES,
    ChatFields,
    NoAssistantTurn,
    to_messages,
    to_tools,
)
from titan_plugins.chat.template import SHIPPED, ChatTemplate, load_chat_template

__all__ = [
    "FORMATS",
    "ROLES",
    "SHIPPED",
    "TRAIN_ON",
    "ChatFields",
    "ChatTemplate",
    "NoAssistantTurn",
    "assistant_spans",
    "encode_conversation",
    "encode_prompt",
    "end_of_turn_ids",
    "load_chat_template",
    "to_messages",
    "to_tools",
]
