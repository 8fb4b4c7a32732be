"""titan-export: a run's DCP checkpoint (any parallelism) to a Hugging Face folder.

    titan-export outputs/2026-01-01/12-00-00 --out qwen3-finetuned
    titan-export outputs/.../checkpoints/step-100 --out qwen3-step100

Writes config.json, sharded safetensors with model.safetensors.index.json and the
run's tokenizer.json; ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
loads it. Exit code 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys

from titan_plugins.errors import TitanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-export", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its newest checkpoint) or a checkpoint's step-N folder")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write (replaced)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from titan_plugins.hf.export import export_checkpoint

    try:
        out = export_checkpoint(args.path, args.out)
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
