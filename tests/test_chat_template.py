"""Chat templates rendered and tokenized as transformers does, and the assistant masks.

The reference is transformers' ``apply_chat_template`` (a test-only dependency) on tiny
tokenizer folders carrying the real Qwen3 and Llama 3.1 templates (tests/chat_helpers.py).
Masks are checked against ``return_assistant_tokens_mask`` on copies of the same
templates with ``{% generation %}`` blocks (rendering the same text), and, for the
prefix-stable Llama template, against a turn-by-turn reference.
"""

from __future__ import annotations

import json

import pytest
from chat_helpers import CONVERSATIONS, DATA, TOOLS, make_folder

from titan_plugins.chat import (
    ChatTemplate,
    encode_conversation,
    encode_prompt,
    end_of_turn_ids,
    load_chat_template,
)
from titan_plugins.data.tokenizer import Tokenizer
from titan_plugins.errors import ConfigError

transformers = pytest.importorskip("transformers")

TAGGED = {"qwen3": "qwen3_generation.jinja", "llama3": "llama3_1_generation.jinja"}
CASES = [(name, tools) for name in CONVERSATIONS for tools in (None, TOOLS)]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for family in TAGGED:
        folder = make_folder(root, family)
        out[family] = {
            "folder": folder,
            "hf": transformers.AutoTokenizer.from_pretrained(str(folder)),
            "template": load_chat_template(None, folder),
            "tok": Tokenizer.load(folder),
            "tagged": (DATA / TAGGED[family]).read_text(encoding="utf-8"),
        }
    return out


def _show(tok, ids, mask):
    return "".join(tok.decode([i]) if m else "." for i, m in zip(ids, mask))


@pytest.mark.parametrize("family", list(TAGGED))
def test_ids_equal_apply_chat_template(families, family):
    f = families[family]
    for name, tools in CASES:
        conv = CONVERSATIONS[name]
        ref_text = f["hf"].apply_chat_template(conv, tools=tools, tokenize=False)
        assert f["template"].render(conv, tools=tools) == ref_text, (name, tools)
        ref = f["hf"].apply_chat_template(conv, tools=tools, tokenize=True, return_dict=False)
        ids, mask = encode_conversation(conv, f["template"], f["tok"], tools=tools)
        assert ids == list(ref), (name, tools)
        assert len(mask) == len(ids) and any(mask)
        for agp in (True,):
            ref = f["hf"].apply_chat_template(conv, tools=tools, add_generation_prompt=agp,
                                              return_dict=False)
            assert encode_prompt(conv, f["template"], f["tok"], tools=tools) == list(ref)


def test_no_doubled_bos(families):
    f = families["llama3"]
    bos = f["tok"].tok.token_to_id("<|begin_of_text|>")
    # the tokenizer's post-processor would add one; the template writes one
    assert f["tok"].tok.encode("hi").ids[0] == bos
    ids, _ = encode_conversation(CONVERSATIONS["single"], f["template"], f["tok"])
    assert ids[0] == bos and ids.count(bos) == 1


@pytest.mark.parametrize("family", list(TAGGED))
def test_masks_equal_generation_reference(families, family):
    """Prefix rendering on the plain template == transformers' generation-tag mask."""
    f = families[family]
    tagged_template = load_chat_template(str(DATA / TAGGED[family]), f["folder"])
    for name, tools in CASES:
        conv = CONVERSATIONS[name]
        assert f["hf"].apply_chat_template(conv, tools=tools, tokenize=False,
                                           chat_template=f["tagged"]) == \
            f["hf"].apply_chat_template(conv, tools=tools, tokenize=False)
        out = f["hf"].apply_chat_template(conv, tools=tools, chat_template=f["tagged"],
                                          return_assistant_tokens_mask=True, return_dict=True)
        ref = [bool(x) for x in out["assistant_masks"]]
        ids, mask = encode_conversation(conv, f["template"], f["tok"], tools=tools)
        assert mask == ref, (name, tools, _show(f["tok"], ids, mask), _show(f["tok"], ids, ref))
        ids2, mask2 = encode_conversation(conv, tagged_template, f["tok"], tools=tools)
        assert (ids2, mask2) == (ids, ref), (name, tools)


def test_masks_turn_by_turn_llama(families):
    """Reference built with apply_chat_template turn by turn (Llama's template renders every
    prefix as the start of the whole conversation): turn k spans the text between
    messages[:k] + the generation prompt and messages[:k+1]; the tokens whose characters
    overlap it count (token ids of a prefix alone can differ at its end: BPE merges)."""
    f = families["llama3"]
    hf = f["hf"]
    for name in CONVERSATIONS:
        conv = CONVERSATIONS[name]
        text = hf.apply_chat_template(conv, tokenize=False)
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == hf.apply_chat_template(conv, return_dict=False)
        ref = [False] * len(enc["input_ids"])
        for k, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            start = len(hf.apply_chat_template(conv[:k], add_generation_prompt=True,
                                               tokenize=False))
            upto = hf.apply_chat_template(conv[: k + 1], tokenize=False)
            assert text.startswith(upto) and upto.endswith("<|eot_id|>")
            for i, (a, b) in enumerate(enc["offset_mapping"]):
                ref[i] = ref[i] or (b > start and a < len(upto))
        ids, mask = encode_conversation(conv, f["template"], f["tok"])
        assert ids == enc["input_ids"] and mask == ref, name


def test_qwen3_think_block_only_in_last_turn(families):
    f = families["qwen3"]
    conv = CONVERSATIONS["system_multi"]
    ids, mask = encode_conversation(conv, f["template"], f["tok"])
    shown = _show(f["tok"], ids, mask)
    assert shown.count("<think>") == 1 and shown.rstrip(".").endswith("84.<|im_end|>")
    assert "Hello! How can I help you today?<|im_end|>" in shown
    assert "assistant" not in shown.replace(".", "")  # headers do not count
    # train_on variants
    ids_l, last = encode_conversation(conv, f["template"], f["tok"], train_on="last_assistant")
    assert ids_l == ids and sum(last) < sum(mask)
    assert _show(f["tok"], ids, last).strip(".") == "<think>\n\n</think>\n\n12 * 7 = 84.<|im_end|>"
    _, every = encode_conversation(conv, f["template"], f["tok"], train_on="all")
    assert all(every)
    with pytest.raises(ConfigError, match="train_on='bogus'"):
        encode_conversation(conv, f["template"], f["tok"], train_on="bogus")


def test_enable_thinking_variable(families):
    f = families["qwen3"]
    conv = CONVERSATIONS["single"][:1]
    ref = f["hf"].apply_chat_template(conv, add_generation_prompt=True, enable_thinking=False,
                                      tokenize=False)
    text = f["template"].with_variables(enable_thinking=False).render(
        conv, add_generation_prompt=True)
    assert text == ref and text.endswith("<think>\n\n</think>\n\n")


def test_end_of_turn_ids(families):
    for family, token in (("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        f = families[family]
        assert end_of_turn_ids(f["template"], f["tok"]) == [f["tok"].tok.token_to_id(token)]


def test_globals_and_filters_match_transformers(families):
    f = families["qwen3"]
    src = ("{{ bos_token is defined }}|{{ eos_token }}|{{ {'a': '<b>&'} | tojson }}|"
           "{{ [1, 2] | tojson(indent=2) }}|{% for m in messages %}{% if loop.first %}"
           "{% continue %}{% endif %}{{ m.role }}{% endfor %}|{{ strftime_now('%Y') }}|"
           "{{ dict(x=1).x }}")
    conv = CONVERSATIONS["system_multi"]
    ref = f["hf"].apply_chat_template(conv, chat_template=src, tokenize=False)
    assert ChatTemplate(src, variables=f["template"].variables).render(conv) == ref
    assert "<b>&" in ref and "False|<|im_end|>" in ref


def test_shipped_chatml_renders_like_transformers(families, tmp_path):
    f = families["qwen3"]
    chatml = load_chat_template("chatml", None)
    text = chatml.render(CONVERSATIONS["tool"])
    ref = f["hf"].apply_chat_template(CONVERSATIONS["tool"], chat_template=chatml.source,
                                      tokenize=False)
    assert text == ref and text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert '<tool_call>\n{"name": "get_weather"' in text
    ids, mask = encode_conversation(CONVERSATIONS["system_multi"], chatml, f["tok"])
    shown = _show(f["tok"], ids, mask).strip(".")
    assert shown.startswith("Hello! How can I help you today?<|im_end|>")
    assert shown.endswith("12 * 7 = 84.<|im_end|>")


# ------------------------------------------------------------------ loading
def test_template_sources(tmp_path):
    conv = CONVERSATIONS["single"]
    expected = load_chat_template(str(DATA / "qwen3.jinja"), None).render(conv)
    for where in ("config", "list", "jinja"):
        folder = make_folder(tmp_path, "qwen3", where=where)
        assert load_chat_template(None, folder).render(conv) == expected, where
        assert load_chat_template(None, folder / "tokenizer.json").render(conv) == expected
    listed = make_folder(tmp_path, "llama3", where="list")
    assert "Cutting Knowledge" in load_chat_template("tool_use", listed).render(conv)
    assert load_chat_template(None, listed).variables["bos_token"] == "<|begin_of_text|>"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    both = make_folder(tmp_path, "qwen3", where="config")
    (both / "chat_template.jinja").write_text("JINJA{{ messages|length }}")
    assert load_chat_template(None, both).render(conv) == "JINJA2"
    # a file beats a shipped name; the shipped name works without a folder
    assert load_chat_template("chatml", None).render(conv).startswith("<|im_start|>user\n")


def test_no_template_is_one_line_error(tmp_path):
    folder = make_folder(tmp_path, "qwen3", where="none")
    with pytest.raises(ConfigError) as err:
        load_chat_template(None, folder)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("data.chat.template:") and "chatml" in msg
    with pytest.raises(ConfigError, match=r"data.chat.template='nope': no such file"):
        load_chat_template("nope", folder)
    with pytest.raises(ConfigError, match="no chat template"):
        load_chat_template(None, None)


def test_render_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.role }")
    with pytest.raises(ConfigError, match="not a valid jinja template") as err:
        load_chat_template(str(bad), None)
    assert "\n" not in str(err.value)
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}", origin="t.jinja")
    with pytest.raises(ConfigError) as err:
        encode_conversation(CONVERSATIONS["single"], raising, None, where="f.jsonl:3")
    assert str(err.value) == ("f.jsonl:3: chat template t.jinja: failed to render: "
                              "roles must alternate")
    # the sandbox: no attribute escapes
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ConfigError, match="failed to render"):
        sandboxed.render(CONVERSATIONS["single"])


def test_unplaceable_turn_is_an_error(families):
    f = families["qwen3"]
    # every assistant turn shows the conversation's length: no prefix renders the same
    src = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
           "{% if m.role == 'assistant' %}{{ messages|length }}{% endif %}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conv = CONVERSATIONS["system_multi"]
    with pytest.raises(ConfigError, match=r"^f:1: messages\[2\]: cannot place"):
        encode_conversation(conv, ChatTemplate(src), f["tok"], where="f:1")
    with pytest.raises(ConfigError, match=r"messages\[6\]: cannot place .* differently from"):
        encode_conversation(conv, ChatTemplate(src), f["tok"], train_on="last_assistant")
    assert all(encode_conversation(conv, ChatTemplate(src), f["tok"], train_on="all")[1])


def test_tokenizer_config_added_token_form(tmp_path):
    folder = make_folder(tmp_path, "llama3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"__type": "AddedToken", "content": "<|begin_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(None, folder).variables["bos_token"] == "<|begin_of_text|>"


def test_template_pickles_and_assistant_first(families):
    import pickle

    f = families["qwen3"]
    copy = pickle.loads(pickle.dumps(f["template"]))
    conv = CONVERSATIONS["system_multi"]
    assert copy.render(conv) == f["template"].render(conv) and copy.variables == \
        f["template"].variables
    first = [{"role": "assistant", "content": "Hi, I am here."}, *CONVERSATIONS["single"]]
    with pytest.raises(ConfigError, match=r"^r:2: messages\[0\]: the conversation starts with an"):
        encode_conversation(first, f["template"], f["tok"], where="r:2")
    # ChatML renders an empty conversation: the first turn is placed
    chatml = load_chat_template("chatml", None)
    ids, mask = encode_conversation(first, chatml, f["tok"])
    assert ids == list(f["hf"].apply_chat_template(first, chat_template=chatml.source,
                                                   return_dict=False))
    assert _show(f["tok"], ids, mask).strip(".").startswith("Hi, I am here.<|im_end|>")
