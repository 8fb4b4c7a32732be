"""Decode tokens/s with and without the KV cache on each first-party debug flavor.

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py [--new-tokens 256] [--prompt-len 16]

Random-init weights (the rate does not depend on them), greedy, batch 1, no EOS stop,
fp32 on CPU: the same `generate` loop `titan-generate` runs (its `--no-cache` is the
uncached path). Prints JSON per model: tokens/s both ways and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titan_plugins.generate import SamplingConfig, generate


def _models():
    from titan_deepseek_v3.config import FLAVORS as DS
    from titan_deepseek_v3.model import build as ds
    from titan_llama4.config import FLAVORS as L4
    from titan_llama4.model import build as l4
    from titan_qwen3.config import FLAVORS as Q3
    from titan_qwen3.model import build as q3

    return {"qwen3": (q3, Q3["debugmodel"]), "llama4": (l4, L4["debugmodel"]), "deepseek_v3": (ds, DS["debugmodel"])}


def _rate(model, prompt, new_tokens: int, use_cache: bool) -> float:
    cfg = SamplingConfig(max_new_tokens=new_tokens, use_cache=use_cache)
    start = time.perf_counter()
    out = generate(model, prompt, cfg)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == new_tokens
    return new_tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    results = {}
    for name, (build, cfg) in _models().items():
        model = build(cfg)
        model.init_weights()
        prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len))
        _rate(model, prompt, 4, True)  # warm-up
        cached = _rate(model, prompt, args.new_tokens, True)
        uncached = _rate(model, prompt, args.new_tokens, False)
        results[name] = {"cached_tok_s": round(cached, 1), "uncached_tok_s": round(uncached, 1),
                         "ratio": round(cached / uncached, 2)}
        print(json.dumps({name: results[name]}), flush=True)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "results": results}))


if __name__ == "__main__":
    main()
