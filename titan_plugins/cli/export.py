"""titan-export: a run's DCP checkpoint (any parallelism) to a Hugging Face folder.

    titan-export outputs/2026-01-01/12-00-00 --out qwen3-finetuned
    titan-export outputs/.../checkpoints/step-100 --out qwen3-step100

Writes config.json, sharded safetensors with model.safetensors.index.json and the
run's tokenizer.json; ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
loads it. ``--out`` must be a new or empty folder; ``--overwrite`` replaces an
earlier titan-export of the same kind there and nothing else (a user's folder, the
run directory, the current directory are never removed: ``titan_plugins.export.out_dir``).
Exit code 0 on success, 2 on bad input, on another export writing the same folder or
on a folder it cannot write (full, read-only: one line, the folder as it was), 1 on an
OS error elsewhere (reading the checkpoint).
"""

from __future__ import annotations

import argparse
import sys

from titan_plugins.errors import TitanError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-export", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its newest checkpoint) or a checkpoint's step-N folder")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write (new or empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it holds an earlier export of the same kind (never anything else)")
    kind = p.add_mutually_exclusive_group()  # LoRA runs (peft=lora): titan_plugins/export/lora.py
    kind.add_argument("--adapter", action="store_true",
                      help="write the LoRA adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors)")
    kind.add_argument("--merge", action="store_true",
                      help="write a full Hugging Face folder with the LoRA adapters merged into the base")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from titan_plugins.export.full import export_checkpoint

    try:
        if args.adapter or args.merge:
            from titan_plugins.export.lora import export_adapter, export_merged

            write = export_adapter if args.adapter else export_merged
            out = write(args.path, args.out, overwrite=args.overwrite)
        else:
            from titan_plugins.export.lora import refuse_lora_full_export

            refuse_lora_full_export(args.path)
            out = export_checkpoint(args.path, args.out, overwrite=args.overwrite)
    except TitanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except OSError as exc:  # outside the writing of --out (out_dir turns those into a TitanError)
        print(f"error: {exc.filename or args.path}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
