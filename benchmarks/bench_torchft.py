"""What fault_tolerance=torchft costs on this CPU.

    python benchmarks/bench_torchft.py [--flavor wide] [--seq 64] [--local-batch 4]
        [--steps 20] [--rounds 2] [--out benchmarks/results/torchft.json]

``healthy``: the same global batch on 2 data-parallel ranks, as 2 replica groups of 1
rank under torchft (its lighthouse, Manager, gloo process group: one quorum, one
cross-group all-reduce and one commit per step) against one job of 2 ranks with
``parallelism.dp_replicate=2`` (the same layout without torchft), interleaved
``--rounds`` times; the median ``step_time_s`` after 3 warm-up steps, and the ratio.

``recovery``: replica 1's rank SIGKILLed right after step 5 (tests/ft_plugin.py), once
with the lighthouse's default heartbeat timeout (5 s) and once with 1 s: the time from
its death (the end of its step 5, from the quorum log) to the survivor's next committed
step, and that step's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def titan_run(overrides: list[str], run_dir: Path, env: dict[str, str] | None = None) -> None:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_PLUGINS_EXTRA": "tiny_plugin,ft_plugin",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    cmd = [sys.executable, "-m", "titan_plugins.cli.run", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"titan-run {' '.join(overrides)} failed: {proc.stderr.strip().splitlines()[-1:]}")


def step_time(run_dir: Path, warmup: int = 3) -> float:
    times = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        times[int(rec["step"])] = float(rec["step_time_s"])
    return statistics.median([times[s] for s in sorted(times)][warmup:])


def recovery(base: list[str], tmp: Path, heartbeat: float) -> dict[str, float]:
    run_dir = tmp / f"recovery-{heartbeat}"
    titan_run([*base, "fault_tolerance=torchft", f"fault_tolerance.heartbeat_timeout_s={heartbeat}",
               "fault_tolerance.max_restarts=0"], run_dir, env={"TITAN_TEST_FT_KILL": "1:5"})
    records = [json.loads(line) for line in (run_dir / "ft_quorums.jsonl").read_text().splitlines()]
    death = next(r["time"] for r in records if r.get("replica") == 1 and r.get("step") == 5)
    nxt = next(r for r in records if r.get("replica") == 0 and r.get("step") == 6 and r["committed"])
    return {"heartbeat_timeout_s": heartbeat, "death_to_next_commit_s": round(nxt["time"] - death, 3),
            "that_step_s": round(nxt["time"] - nxt["started"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="wide")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--local-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = ["model=tiny", f"model.flavor={args.flavor}", f"training.seq_len={args.seq}",
            f"training.local_batch_size={args.local_batch}", f"training.steps={args.steps}",
            "metrics.tensorboard=false", "metrics.console=false"]
    runs: dict[str, list[float]] = {"plain": [], "torchft": []}
    with tempfile.TemporaryDirectory(prefix="bench-torchft-") as tmp_name:
        tmp = Path(tmp_name)
        for r in range(args.rounds):
            titan_run([*base, "parallelism.dp_replicate=2"], tmp / f"plain-{r}")
            runs["plain"].append(step_time(tmp / f"plain-{r}"))
            titan_run([*base, "fault_tolerance=torchft"], tmp / f"ft-{r}")
            runs["torchft"].append(step_time(tmp / f"ft-{r}"))
        plain, ft = statistics.median(runs["plain"]), statistics.median(runs["torchft"])
        result = {
            "cpu_cores": os.cpu_count(), "flavor": args.flavor, "seq_len": args.seq, "global_batch": 2 * args.local_batch,
            "healthy": {"plain_dp_replicate2_step_s": round(plain, 4), "torchft_2x1_step_s": round(ft, 4),
                        "ratio": round(ft / plain, 3), "rounds": runs},
            "recovery": [recovery(base, tmp, hb) for hb in (5.0, 1.0)],
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
