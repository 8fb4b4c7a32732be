"""Inference tokenizes a prompt as training tokenized a document (issue 25, item 4):
BOS first where the tokenizer has one (titan-generate and the lm-eval adapter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from titan_plugins.data.sources import encode_documents
from titan_plugins.data.tokenizer import build_tokenizer
from titan_plugins.generate.prompt import document_start, encode_prompt

TOK = build_tokenizer(OmegaConf.create({"tokenizer": None}))  # the shipped one: BOS and EOS


class _Recorder(torch.nn.Module):
    """Logits that always favour token 5; remembers every input it saw."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.seen = vocab, []

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        self.seen.append(tokens[0].tolist())
        logits = torch.zeros(*tokens.shape, self.vocab)
        logits[..., 5] = 1.0
        return logits


def test_a_prompt_starts_like_a_training_document() -> None:
    text = "Once upon a time"
    assert TOK.bos_id >= 0
    document = encode_documents([text], TOK).tolist()  # what training packs: BOS text EOS
    assert encode_prompt(TOK, text) == document[:-1]
    no_bos = SimpleNamespace(bos_id=-1, eos_id=9)  # GPT-2 style: documents follow an EOS
    assert document_start(no_bos) == [9]
    assert document_start(SimpleNamespace()) == []


def test_titan_generate_feeds_bos_first(monkeypatch, capsys) -> None:
    import titan_plugins.generate.load as load
    from titan_plugins.cli.generate import main

    model = _Recorder(TOK.vocab_size)
    monkeypatch.setattr(load, "load_checkpoint", lambda path, device: SimpleNamespace(model=model, tokenizer=TOK))
    assert main(["run-dir", "--prompt", "hello there", "--max-new-tokens", "2", "--no-cache", "--ignore-eos"]) == 0
    assert model.seen[0] == [TOK.bos_id, *TOK.encode("hello there")]
    assert capsys.readouterr().out.startswith("hello there")  # the BOS is not printed


def test_lm_eval_adapter_contexts_start_with_bos() -> None:
    pytest.importorskip("lm_eval")
    from titan_plugins.generate.lm_eval_adapter import TitanLM

    model = _Recorder(TOK.vocab_size)
    lm = TitanLM(model, TOK, 64, torch.device("cpu"))
    req = lambda *a: SimpleNamespace(args=a)  # noqa: E731
    lm.loglikelihood([req("The cat", " sat")])
    assert model.seen[-1] == [TOK.bos_id, *TOK.encode("The cat"), *TOK.encode(" sat")][:-1]
    lm.loglikelihood([req("", "sat")])  # an empty context is BOS, not EOS
    assert model.seen[-1][0] == TOK.bos_id and TOK.eos_id not in model.seen[-1]
    lm.loglikelihood_rolling([req("a b c")])
    assert model.seen[-1] == [TOK.bos_id, *TOK.encode("a b c")][:-1]
    lm.generate_until([req("The cat", {"until": ["\n"], "max_gen_toks": 1})])
    assert model.seen[-1] == [TOK.bos_id, *TOK.encode("The cat")]
