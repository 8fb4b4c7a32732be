"""titan-generate --chat / --messages: the prompt is the run's chat template with the assistant
header, the reply stops at the end-of-turn token; a scripted model stands in for a trained one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import titan_plugins.generate.load as gen_load
from titan_plugins.chat import load_chat_template
from titan_plugins.chat.prompting import chat_prompt, read_messages, template_for
from titan_plugins.cli.generate import main as generate_main
from titan_plugins.data.tokenizer import ASSETS, Tokenizer
from titan_plugins.errors import ConfigError

CHAT_TOKENIZER = ASSETS / "chat_tokenizer"


class ScriptedModel(torch.nn.Module):
    """Writes ``script`` after whatever prompt it gets (no cache: it sees the whole prefix)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab, self.prompts = script, vocab, []

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        if not self.prompts or tokens.shape[1] < len(self.prompts[-1]):
            self.prompts.append(tokens[0].tolist())
        step = tokens.shape[1] - len(self.prompts[-1])
        logits = torch.zeros(tokens.shape[0], tokens.shape[1], self.vocab)
        logits[:, -1, self.script[min(step, len(self.script) - 1)]] = 1.0
        return logits


@pytest.fixture
def chat_run(monkeypatch):
    tok = Tokenizer.load(CHAT_TOKENIZER)
    end = tok.tok.token_to_id("<|im_end|>")
    model = ScriptedModel(tok.encode("Paris is the capital.") + [end, *tok.encode(" junk")],
                          tok.vocab_size)
    job = OmegaConf.create({"data": {"name": "chat_sample", "tokenizer": None, "chat": {}}})

    def fake_load(path, device, pm=None):
        return gen_load.Loaded(model, tok, job, Path(path))

    monkeypatch.setattr(gen_load, "load_checkpoint", fake_load)
    return model, tok


def test_chat_prompt_uses_the_template_and_stops_at_end_of_turn(chat_run, capsys):
    model, tok = chat_run
    args = ["run-dir", "--chat", "What is the capital of France?", "--system", "Be brief.",
            "--no-cache", "--max-new-tokens", "40"]
    assert generate_main(args) == 0
    assert capsys.readouterr().out == "Paris is the capital.\n"
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert model.prompts[0] == tok.encode(expected)
    assert tok.tok.token_to_id("<|im_start|>") in model.prompts[0]


def test_messages_file(chat_run, tmp_path, capsys):
    model, tok = chat_run
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Capital of France?"}]}))
    assert generate_main(["run-dir", "--messages", str(conv), "--no-cache"]) == 0
    assert capsys.readouterr().out == "Paris is the capital.\n"
    text = tok.decode(model.prompts[0])
    assert text.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!")
    assert text.endswith("Capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_bad_messages_file_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(gen_load, "load_checkpoint", no_load)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "narrator", "content": "x"}]))
    assert generate_main(["run-dir", "--messages", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --messages={bad}: messages[0].role='narrator': unknown role "
                   "(expected system, user, assistant, tool)")
    assert generate_main(["run-dir", "--messages", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.strip().endswith("none.json: no such file")


def test_template_for_a_run(tmp_path):
    # a chat run without data.tokenizer: the shipped ChatML tokenizer folder's template
    assert "<|im_start|>" in template_for({"name": "chat", "chat": {}}, None).source
    # data.chat.template wins over the folder's; --chat-template over both
    assert template_for({"name": "chat", "chat": {"template": "chatml"}}, None).origin == \
        "shipped:chatml"
    custom = tmp_path / "t.jinja"
    custom.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_for({"name": "chat", "chat": {"template": "chatml"}}, str(custom)).origin == \
        str(custom)
    # a text run whose tokenizer has no template: one line naming the option
    with pytest.raises(ConfigError, match=r"^--chat-template: the tokenizer has no chat template"):
        template_for({"name": "builtin", "tokenizer": str(ASSETS / "tokenizer.json")}, None)


def test_chat_prompt_ids_and_stop(tmp_path):
    tok = Tokenizer.load(CHAT_TOKENIZER)
    template = load_chat_template(None, CHAT_TOKENIZER)
    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{}\n")
    ids, stop = chat_prompt(read_messages(conv), template, tok)
    assert stop == tok.tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ConfigError, match="--chat: the conversation is empty"):
        chat_prompt([], template, tok)
