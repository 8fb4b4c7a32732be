"""Data pipeline tokens/s alone (no model) vs what the trainer consumes.

    OMP_NUM_THREADS=1 python benchmarks/bench_data.py [--mb 100] [--steps 8] [--models qwen3,llama4]

Writes a JSONL corpus of ``--mb`` MB (random lines) into a temp dir, then

- ``loader``: tokens/s of ``build_dataloader`` on it (seq 2048 x batch 8, the
  shipped tokenizer) with ``data.num_workers`` 0 and 2, after the first batch;
- ``trainer``: tokens/s of a one-rank ``titan-run`` (median step after the first) of
  each debug flavor on the same corpus (``data.num_workers=1``).

Prints one JSON object. The loader must be well above every trainer number.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = "the of and to in is that for it as with was on be by this are or from at an".split()


def write_corpus(root: Path, mb: int) -> Path:
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[j] for j in row) + "." for row in rng.integers(0, len(WORDS), (4000, 40))]
    block = "".join(json.dumps({"text": f"{i} {t}"}) + "\n" for i, t in enumerate(lines)).encode()
    path = root / "corpus.jsonl"
    with open(path, "wb") as f:
        for _ in range((mb << 20) // len(block) + 1):
            f.write(block)
    return path


def loader_rate(path: Path, workers: int, batches: int, seq_len: int, batch: int) -> float:
    from titan_plugins.config.schema import DataConfig
    from titan_plugins.data import build_dataloader, build_tokenizer
    from titan_plugins.data.builtin import DATASETS

    data = DataConfig(name="jsonl", path=str(path), num_workers=workers)
    dl = build_dataloader(data, build_tokenizer(data), dp_rank=0, dp_world=1, local_batch_size=batch,
                          seq_len=seq_len, seed=0, datasets={s.name: s for s in DATASETS})
    next(dl)  # worker start-up is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(dl)
    return batches * batch * seq_len / (time.perf_counter() - start)


def trainer_rate(path: Path, model: str, steps: int, root: Path) -> float | None:
    from titan_plugins.train.api import run

    r = run([f"model={model}", f"training.steps={steps}", "data.name=jsonl", f"data.path={path}",
             "data.num_workers=1", "metrics.tensorboard=false", "metrics.console=false"],
            run_dir=root / f"run-{model}", timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{model}: {r.error}")
    return r.tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default="qwen3,llama4,deepseek_v3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = write_corpus(root, args.mb)
        out = {"corpus_mb": round(path.stat().st_size / 2**20)}
        for workers in (0, 2):
            out[f"loader_tokens_per_s_workers{workers}"] = round(loader_rate(path, workers, args.batches, 2048, 8))
        for model in filter(None, args.models.split(",")):
            rate = trainer_rate(path, model, args.steps, root)
            out[f"trainer_tokens_per_s_{model}"] = round(rate) if rate else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
