"""Sharded ``model.hf`` load vs one rank loading the whole folder.

    OMP_NUM_THREADS=1 python benchmarks/bench_hf_load.py [--ranks 4] [--folder DIR]

Writes a random Qwen3-0.6B-shaped Hugging Face folder (bf16 safetensors in shards
with an index; kept in --folder if given, else a temporary directory), then times
``titan_plugins.hf.load.load_hf_weights`` (a) in one process holding the whole model
and (b) on ``--ranks`` gloo ranks with FSDP (dp_shard = ranks), weights in bf16
(``precision.weight_dtype=bfloat16``). Prints JSON: per rank the load's seconds,
the bytes of its own weight shards, its peak RSS (VmHWM, MiB) before and after the
load (torch + the empty model, then the load), and the folder's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

import torch


def _rss_mib() -> float:
    """Peak resident set of this process (VmHWM: unlike getrusage's ru_maxrss it
    does not carry over the parent's peak across the spawn's exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config():
    from titan_qwen3.config import FLAVORS

    return FLAVORS["0.6B"]


def write_folder(folder: Path) -> int:
    """A random 0.6B-shaped folder, written a few layers at a time."""
    from titan_qwen3.hf_config import config_to_hf
    from titan_qwen3.model import build
    from titan_qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from titan_plugins.hf.export import write_safetensors

    cfg = _config()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config_to_hf(cfg), "dtype": "bfloat16"}))
    with torch.device("meta"):
        meta = build(cfg)
    hf_meta = Qwen3StateDictAdapter(cfg).to_hf(meta.state_dict())
    g = torch.Generator().manual_seed(0)
    hf = {k: (torch.randn(v.shape, generator=g) * 0.02).to(torch.bfloat16) for k, v in hf_meta.items()}
    write_safetensors(hf, folder, dtype=torch.bfloat16)
    return sum(t.numel() * 2 for t in hf.values())


def _model(parallel_dims=None):
    from omegaconf import OmegaConf
    from titan_qwen3.model import build
    from titan_qwen3.parallelize import parallelize

    from titan_plugins.config.schema import JobConfig

    cfg = _config()
    with torch.device("meta"):
        model = build(cfg)
    if parallel_dims is not None:
        job = OmegaConf.structured(JobConfig(model={}))
        job.parallelism.dp_shard = parallel_dims.dp_shard
        model = parallelize(model, parallel_dims, job)
    model.to_empty(device="cpu")
    model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    return model


def _load(model, folder: str) -> dict:
    from titan_plugins.hf.load import load_hf_weights
    from titan_plugins.plugins import get_plugin_manager

    spec = get_plugin_manager().get_model("qwen3")
    from torch.distributed.tensor import DTensor

    local = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in model.state_dict().values())
    before = _rss_mib()
    t0 = time.perf_counter()
    counts = load_hf_weights([model], spec, _config(), folder)
    return {"seconds": round(time.perf_counter() - t0, 2), "local_weights_mib": round(local / 2**20),
            "peak_rss_before_load_mib": round(before), "peak_rss_mib": round(_rss_mib()), **counts}


def _one_rank(folder: str, out: str) -> None:
    torch.set_num_threads(1)
    Path(out).write_text(json.dumps(_load(_model(), folder)))


def _rank(rank: int, world: int, port: int, folder: str, out_dir: str) -> None:
    import torch.distributed as dist

    from titan_plugins.config.schema import ParallelismConfig
    from titan_plugins.distributed.parallel_dims import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = ParallelDims.from_config(ParallelismConfig(dp_shard=world), world)
    dims.build_meshes("cpu")
    model = _model(dims)
    dist.barrier()
    result = _load(model, folder)
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--folder", help="keep the generated folder here (reused if it has config.json)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or Path(tmp) / "qwen3-0.6B-random")
        if not (folder / "config.json").is_file():
            write_folder(folder)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_one_rank, args=(str(folder), f"{tmp}/one.json"))
        proc.start()
        proc.join()
        one = json.loads(Path(f"{tmp}/one.json").read_text())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(args.ranks, port, str(folder), tmp), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(json.dumps({"folder_mib": round(size / 2**20), "one_rank_whole": one,
                      f"{args.ranks}_ranks_fsdp": ranks, "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
