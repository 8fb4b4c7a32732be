"""Warm launches: ``train.api.run`` with the zygote (``TITAN_WARM_START=1``, the default)
against a fresh ``python -m titan_plugins.train.worker`` per job (``=0``), interleaved.

    python benchmarks/bench_warm_start.py --rounds 4 --out benchmarks/results/warm_start.json

Each job: llama3, 2 layers of dim 64, 2 steps of one 32-token row, on 1 rank and on 2
(``fsdp2``); and ``model=hf`` on a tiny Llama folder (``save_pretrained`` here) on 2 ranks
(``hf-fsdp2``): cold, the fork server imports transformers once for both ranks (the
model's ``rank_imports``); warm, the zygote imported it before the first job. Reported per job: wall seconds and the CPU seconds the whole box spent meanwhile
(``/proc/stat``; the launcher, its fork server and the ranks all count, other load too: run
it on a quiet box). The first warm job of the process pays for the zygote and is reported
apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

LAYOUTS = ("single", "fsdp2", "hf-fsdp2")
JOB = ["model=llama3", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.vocab_size=2048",
       "training.seq_len=32", "training.steps=2", "metrics.tensorboard=false", "metrics.console=false"]


def _box_cpu() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")


def _hf_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _job(folder: Path, warm: bool, layout: str, hf: Path) -> tuple[float, float]:
    from titan_plugins.train.api import run

    os.environ["TITAN_WARM_START"] = "1" if warm else "0"
    argv = [*JOB, f"parallelism={layout}"]
    if layout.startswith("hf-"):
        argv = ["model=hf", f"model.hf={hf}", *JOB[5:], f"parallelism={layout[3:]}"]
    wall, cpu = time.perf_counter(), _box_cpu()
    result = run(argv, run_dir=folder, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{layout} warm={warm}: {result.error}")
    return time.perf_counter() - wall, _box_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    hf = _hf_folder(tmp / "hf")
    first = _job(tmp / "first", True, "single", hf)
    rows: dict[str, dict[str, list]] = {}
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            for warm in (round_ % 2 == 0, round_ % 2 == 1):  # alternate which goes first
                wall, cpu = _job(tmp / f"{layout}-{warm}-{round_}", warm, layout, hf)
                row = rows.setdefault(f"{layout}/{'warm' if warm else 'cold'}", {"wall_s": [], "cpu_s": []})
                row["wall_s"].append(round(wall, 2))
                row["cpu_s"].append(round(cpu, 2))
    report = {"first_warm_job": {"wall_s": round(first[0], 2), "cpu_s": round(first[1], 2)},
              "jobs": {k: {**v, "median_wall_s": statistics.median(v["wall_s"]),
                           "median_cpu_s": statistics.median(v["cpu_s"])} for k, v in rows.items()}}
    for layout in LAYOUTS:
        warm, cold = report["jobs"][f"{layout}/warm"], report["jobs"][f"{layout}/cold"]
        report[f"{layout}_cold_over_warm"] = {"wall": round(cold["median_wall_s"] / warm["median_wall_s"], 2),
                                              "cpu": round(cold["median_cpu_s"] / warm["median_cpu_s"], 2)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
