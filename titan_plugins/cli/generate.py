"""titan-generate: sample text from a run's checkpoint or a Hugging Face folder.

    titan-generate outputs/2026-01-01/12-00-00 --prompt "Once upon a time"
    titan-generate outputs/.../checkpoints/step-100 --prompt-file p.txt --temperature 0.8 --top-p 0.9
    titan-generate --hf qwen3-folder --model qwen3 --prompt "Hello" --max-new-tokens 32

One process, CPU or one GPU, with a KV cache (``--no-cache`` re-runs the whole
prefix per token: the reference). Stops at the tokenizer's EOS. Exit 0, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from titan_plugins.errors import TitanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-generate", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("path", nargs="?", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its newest checkpoint) or a checkpoint's step-N folder")
    p.add_argument("--hf", metavar="DIR", help="a Hugging Face folder instead of a checkpoint (needs --model)")
    p.add_argument("--model", help="the registry name for --hf (e.g. qwen3)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix per token")
    p.add_argument("--ignore-eos", action="store_true", help="always produce --max-new-tokens")
    p.add_argument("--stats", action="store_true", help="print tokens/s to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (TitanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", 2)


def _run(args: argparse.Namespace) -> int:
    from titan_plugins.errors import ConfigError
    from titan_plugins.generate.sampling import SamplingConfig

    if (args.path is None) == (args.hf is None):
        raise ConfigError("give either RUN_DIR_OR_CHECKPOINT or --hf DIR")
    if args.hf is not None and not args.model:
        raise ConfigError(f"--hf={args.hf}: --model NAME is required")
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        raise ConfigError(f"--prompt-file={args.prompt_file}: no such file")
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
    cfg.check()

    import torch

    from titan_plugins.generate.load import load_checkpoint, load_hf
    from titan_plugins.generate.sampling import generate

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    loaded = load_hf(args.hf, args.model, device) if args.hf else load_checkpoint(args.path, device)
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    ids = loaded.tokenizer.encode(text)
    if not ids:
        raise ConfigError("--prompt: encodes to no tokens")
    eos = getattr(loaded.tokenizer, "eos_id", None)
    cfg.eos_id = None if args.ignore_eos or eos is None or eos < 0 else eos
    prompt = torch.tensor([ids], device=device)
    start = time.perf_counter()
    out = generate(loaded.model, prompt, cfg)[0].tolist()
    elapsed = time.perf_counter() - start
    if cfg.eos_id is not None and out and out[-1] == cfg.eos_id:
        out = out[:-1]
    print(text + loaded.tokenizer.decode(out), flush=True)
    if args.stats:
        print(f"{len(out)} tokens in {elapsed:.3f} s: {len(out) / elapsed:.1f} tokens/s "
              f"({'cache' if cfg.use_cache else 'no cache'})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
