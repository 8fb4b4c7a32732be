"""Train a byte-level BPE tokenizer on your own text, for ``data.tokenizer=...``.

    python -m titan_plugins.data.train_tokenizer DATA --out tokenizer.json \\
        [--vocab-size 2048] [--text-field text]

``DATA`` is a ``.txt`` file, a ``.jsonl`` file (text in ``--text-field``) or a
directory of either. The result has the shipped tokenizer's format and special
tokens (``<|bos|>``, ``<|eos|>`` last; a Hugging Face tokenizer.json made with the
``tokenizers`` trainer), so any first-party model whose
``vocab_size`` is at least ``--vocab-size`` trains on it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from titan_plugins.errors import ConfigError

__all__ = ["read_documents", "main"]


def read_documents(path: str, text_field: str) -> list[str]:
    from titan_plugins.data.sources import find_files, read_jsonl, read_text

    files = find_files(path, (".txt", ".jsonl"), "train_tokenizer", key="DATA")
    jsonl = [f for f in files if f.suffix == ".jsonl"]
    docs = (read_jsonl(jsonl, text_field) if jsonl else []) + read_text([f for f in files if f not in jsonl])
    if not any(doc.strip() for doc in docs):
        raise ConfigError(f"DATA={path!r} holds no text")
    return docs


def main(argv: list[str] | None = None) -> int:
    from titan_plugins.data.tokenizer import SPECIAL_TOKENS, train_bpe

    parser = argparse.ArgumentParser(prog="python -m titan_plugins.data.train_tokenizer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a .txt or .jsonl file, or a directory of them")
    parser.add_argument("--out", required=True, help="where to write tokenizer.json (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--text-field", default="text", help="the text key of JSONL records")
    args = parser.parse_args(argv)
    try:
        if args.vocab_size <= 256 + len(SPECIAL_TOKENS):
            raise ConfigError(f"--vocab-size={args.vocab_size} must exceed {256 + len(SPECIAL_TOKENS)} "
                              "(the 256 bytes and the special tokens)")
        if os.path.exists(args.out) and not args.overwrite:
            raise ConfigError(f"--out {args.out}: exists (pass --overwrite to replace it)")
        docs = read_documents(args.data, args.text_field)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    t0 = time.perf_counter()
    tokenizer = train_bpe(docs, args.vocab_size)
    tokenizer.save(args.out)
    print(f"trained {len(tokenizer.merges)} merges on {len(docs)} documents (vocab {tokenizer.vocab_size}) "
          f"in {time.perf_counter() - t0:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
