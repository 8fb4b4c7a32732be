"""Rebuild the shipped tokenizer and encoded corpus from ``assets/corpus.jsonl``.

    python -m titan_plugins.data.build_assets              # tokenizer + tokens
    python -m titan_plugins.data.build_assets --from-pydoc # re-extract the corpus first

``--from-pydoc`` takes the corpus from this Python's ``pydoc_data.topics`` (the
language reference, PSF licence), so it depends on the Python version; the
default keeps the shipped corpus and is reproducible on any Python.
"""

from __future__ import annotations

import argparse
import json
import time

from titan_plugins.data.sources import (
    CORPUS,
    CORPUS_TOKENS,
    corpus_key,
    encode_documents,
    read_jsonl,
    save_tokens,
)
from titan_plugins.data.tokenizer import DEFAULT_TOKENIZER, train_bpe

VOCAB_SIZE = 2048  # the first-party debug models' vocabulary


def extract_pydoc_corpus() -> int:
    import pydoc_data.topics

    with CORPUS.open("w") as f:
        for title, text in sorted(pydoc_data.topics.topics.items()):
            f.write(json.dumps({"title": title, "text": text.strip() + "\n"}) + "\n")
    return len(pydoc_data.topics.topics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-pydoc", action="store_true", help="re-extract the corpus first")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    if args.from_pydoc:
        print(f"extracted {extract_pydoc_corpus()} documents into {CORPUS}")
    docs = read_jsonl(CORPUS, "text")
    t0 = time.perf_counter()
    tokenizer = train_bpe(docs, args.vocab_size)
    tokenizer.save(DEFAULT_TOKENIZER)
    print(
        f"trained {len(tokenizer.merges)} merges (vocab {tokenizer.vocab_size}) "
        f"in {time.perf_counter() - t0:.1f}s -> {DEFAULT_TOKENIZER}"
    )
    t0 = time.perf_counter()
    tokens = encode_documents(docs, tokenizer)
    save_tokens(CORPUS_TOKENS, tokens, corpus_key(tokenizer))
    chars = sum(map(len, docs))
    print(
        f"encoded {chars} characters into {tokens.size} tokens "
        f"({chars / tokens.size:.2f} chars/token) in {time.perf_counter() - t0:.1f}s "
        f"-> {CORPUS_TOKENS}"
    )


if __name__ == "__main__":
    main()
