"""titan-generate: sample text from a run's checkpoint or a Hugging Face folder.

    titan-generate outputs/2026-01-01/12-00-00 --prompt "Once upon a time"
    titan-generate outputs/.../checkpoints/step-100 --prompt-file p.txt --temperature 0.8 --top-p 0.9
    titan-generate --hf qwen3-folder --model qwen3 --prompt "Hello" --max-new-tokens 32
    titan-generate outputs/.../chat-run --chat "How does assert work?" --system "Be brief."
    titan-generate --hf qwen3-folder --model qwen3 --messages conversation.json

One process, CPU or one GPU, with a KV cache (``--no-cache`` re-runs the whole
prefix per token: the reference). The prompt starts with BOS, as every training
document does; generation stops at the tokenizer's EOS. Exit 0, 2 on bad input.
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
    src.add_argument("--chat", metavar="TEXT", help="a user message, through the run's chat template")
    src.add_argument("--messages", metavar="FILE", help="a conversation (JSON messages) through the chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat/--messages: a system message first")
    p.add_argument("--chat-template", metavar="FILE_OR_NAME", help="the chat template (default: the run's)")
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
    if args.messages is not None:
        from titan_plugins.chat.prompting import read_messages

        read_messages(args.messages)  # a bad file fails before the model loads
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
    cfg.check()

    import torch

    from titan_plugins.generate.load import load_checkpoint, load_hf
    from titan_plugins.generate.prompt import encode_prompt
    from titan_plugins.generate.sampling import generate

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    loaded = load_hf(args.hf, args.model, device) if args.hf else load_checkpoint(args.path, device)
    stop = None
    if args.chat is not None or args.messages is not None:  # the reply alone is printed
        from titan_plugins.chat.prompting import chat_prompt, read_messages, template_for

        messages = read_messages(args.messages) if args.messages else [{"role": "user", "content": args.chat}]
        messages = [{"role": "system", "content": args.system}] * bool(args.system) + messages
        text, (ids, stop) = "", chat_prompt(messages, template_for(loaded.job.data, args.chat_template),
                                            loaded.tokenizer)
    else:
        text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
        if not loaded.tokenizer.encode(text):
            raise ConfigError("--prompt: encodes to no tokens")
        ids = encode_prompt(loaded.tokenizer, text)  # as transformers tokenizes it (the BOS it adds)
    eos = stop if stop is not None else getattr(loaded.tokenizer, "eos_id", None)
    cfg.eos_id = None if args.ignore_eos or eos is None or eos < 0 else eos
    if cfg.eos_id is not None and stop is None:  # every EOS the folder ends generation with
        cfg.stop_ids = tuple(getattr(loaded.tokenizer, "eos_ids", ()))
    prompt = torch.tensor([ids], device=device)
    start = time.perf_counter()
    out = generate(loaded.model, prompt, cfg)[0].tolist()
    elapsed = time.perf_counter() - start
    if out and out[-1] in cfg.stops():
        out = out[:-1]
    print(text + loaded.tokenizer.decode(out), flush=True)
    if args.stats:
        print(f"{len(out)} tokens in {elapsed:.3f} s: {len(out) / elapsed:.1f} tokens/s "
              f"({'cache' if cfg.use_cache else 'no cache'})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
