"""An ``lm_eval`` model over a loaded titan model (``titan-eval``).

``loglikelihood`` scores a continuation given a context (sum of log-probs and whether
greedy decoding would produce it), ``loglikelihood_rolling`` a whole text in windows of
the model's context, ``generate_until`` decodes greedily (KV cache) until a stop string.
One process, one request at a time: meant for small local tasks, not throughput.

Every context is tokenized as transformers tokenizes a text, which is how training
starts a document (``generate.prompt.encode_prompt``: what the tokenizer adds before a
text, then the text); an empty context, and the first token of a rolling text, follow
``document_start`` (that prefix, else EOS: lm-eval's ``prefix_token_id``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM

from titan_plugins.generate.prompt import document_start, encode_prompt, text_prefix
from titan_plugins.generate.sampling import SamplingConfig, generate


class TitanLM(LM):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int, device: torch.device) -> None:
        super().__init__()
        self.model, self.tok, self.max_length, self._device = model.eval(), tokenizer, max_length, device
        eos = getattr(tokenizer, "eos_id", None)
        self.eos_id = eos if eos is not None and eos >= 0 else None
        self.prefix = document_start(tokenizer)  # what a text with no context follows

    @torch.no_grad()
    def _logprobs(self, ids: list[int], n_target: int) -> tuple[float, bool]:
        """Log-prob of the last ``n_target`` ids given the ones before (left-truncated)."""
        ids = ids[-(self.max_length + 1):]
        inp = torch.tensor([ids[:-1]], device=self._device)
        logits = self.model(inp)[0, -n_target:].float()
        target = torch.tensor(ids[-n_target:], device=self._device)
        logp = F.log_softmax(logits, dim=-1)
        return float(logp.gather(1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx = encode_prompt(self.tok, context) if context else list(self.prefix)
            cont = self.tok.encode(continuation)
            out.append(self._logprobs(ctx + cont, len(cont)))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            ids = self.tok.encode(req.args[0])
            full = self.prefix + ids
            # scored from the text's first id on, given the prefix (without one, the first
            # id has no context and is not scored)
            first = max(len(self.prefix), 1)
            n = len(full) - first
            total = 0.0
            for start in range(0, n, self.max_length):  # disjoint windows, each with full context
                end = min(start + self.max_length, n)
                total += self._logprobs(full[: first + end], end - start)[0]
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            head = text_prefix(self.tok)  # what the tokenizer adds before a text
            room = self.max_length - len(head)
            ids = head + self.tok.encode(context)[-room:]
            budget = min(int(kwargs.get("max_gen_toks", 64)), self.max_length - len(ids))
            cfg = SamplingConfig(max_new_tokens=max(budget, 1), eos_id=self.eos_id,
                                 stop_ids=tuple(getattr(self.tok, "eos_ids", ())))
            new = generate(self.model, torch.tensor([ids], device=self._device), cfg)[0].tolist()
            ends = [k for k, t in enumerate(new) if t in cfg.stops()]
            if ends:
                new = new[: ends[0]]
            text = self.tok.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out
