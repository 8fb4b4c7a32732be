"""The matrix's multi-rank columns: each type equal to transformers on one rank trains
3 fp32 steps through ``titan-run`` on every layout (gloo ranks, the same global batch)
and is compared with its own one-rank run of the same folder.

    cells = layout_cells({"llama": folder, "qwen2_moe": folder2}, ["fsdp2", "ep2"], work)
    cells["llama"] == {"fsdp2": "equal", "ep2": "n/a"}

Every job is composed and validated first (``prepare_job``): a ``ConfigError`` is the
cell ``refused: <line>`` (or ``n/a`` where the layout does not apply: no experts for
ep2, tied embeddings for pp2, no SDPA for cp2), before any rank starts. The jobs that
compose train in one launch per world size, every type together (one rank: the
baselines; 2 ranks: fsdp2, pp2, ep2, cp2; 4 ranks: fsdp2_tp2), and a job that fails
inside a rank is its own ``error: <line>`` (``titan_hf.matrix_runs.launch_jobs``).
``fsdp2_tp2`` runs with sequence parallelism where ``validate`` allows it, else without
(the cell says ``(no SP)``).
"""

from __future__ import annotations

from pathlib import Path

from titan_plugins.errors import ConfigError

__all__ = ["COMMON", "LAYOUTS", "NOT_APPLICABLE", "STEPS", "layout_cells"]

STEPS = 3
COMMON = ["model=hf", "data=synthetic", "data.vocab_size=256", f"training.steps={STEPS}",
          "training.deterministic=true", "training.seq_len=16", "training.local_batch_size=4",
          "training.lr=1e-3", "training.warmup_steps=0", "metrics.tensorboard=false", "metrics.console=false",
          "model.verify=false"]  # the one-rank column compares against transformers already
NO_SP = "parallelism.sequence_parallel=false"
#: ``--layouts`` names -> (world size, titan-run overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "fsdp2": (2, ["parallelism=fsdp2"]),
    "fsdp2_tp2": (4, ["parallelism=fsdp2_tp2"]),
    "pp2": (2, ["parallelism=pp2"]),
    "ep2": (2, ["parallelism=fsdp2_ep2"]),
    "cp2": (2, ["parallelism=cp2"]),
}
#: a refusal that means the layout does not apply to the type (the cell is ``n/a``)
NOT_APPLICABLE: dict[str, str] = {
    "ep2": "has no experts",
    "pp2": "model.enable_weight_tying=true cannot run with",
    "cp2": "without SDPA",
}
EQUAL = 1e-5


_COMPOSED: dict[tuple[str, ...], object] = {}


def _compose(argv: list[str], run_dir: Path) -> Path:
    """``prepare_job(argv)``'s job written to ``run_dir``: Hydra composes each list of
    overrides without ``model.hf`` once (the same for every type), the folder is set after."""
    import copy

    from omegaconf import open_dict

    from titan_plugins.config.compose import compose
    from titan_plugins.plugins import get_plugin_manager
    from titan_plugins.train.api import finish_job
    from titan_plugins.train.run_files import write_config

    pm = get_plugin_manager(strict=True)
    folder = next(a for a in argv if a.startswith("model.hf="))
    key = tuple(a for a in argv if a != folder)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(list(key), pm)
    cfg = copy.deepcopy(_COMPOSED[key])
    with open_dict(cfg):
        cfg.model.hf = folder.split("=", 1)[1]
    return write_config(finish_job(cfg, pm, run_dir=run_dir)[1], run_dir)


def _refusal(layout: str, exc: BaseException) -> str:
    from titan_hf.matrix_runs import one_line

    if not isinstance(exc, ConfigError):
        return f"error: {one_line(exc)}"
    text = one_line(exc)
    return "n/a" if NOT_APPLICABLE.get(layout, "\0") in text else f"refused: {text}"


def layout_cells(folders: dict[str, Path], layouts: list[str], work: Path, *,
                 timeout: float = 300) -> dict[str, dict[str, str]]:
    """``type -> layout -> cell`` for the types of ``folders`` (``type -> tiny folder``):
    ``equal``, ``differ: <max diff>``, ``refused: <line>``, ``error: <line>`` or ``n/a``;
    ``timeout``: seconds a launch may go without finishing a job."""
    from titan_hf.matrix_runs import launch_jobs
    from titan_plugins.compare.runner import match_global_batch

    work = Path(work)
    cells: dict[str, dict[str, str]] = {t: {} for t in folders}
    base: dict[str, Path] = {}
    jobs: dict[int, dict[str, Path]] = {}
    notes: dict[str, str] = {}
    for model_type, folder in folders.items():
        argv = [*COMMON, f"model.hf={folder}", "parallelism=single"]
        try:
            base[model_type] = _compose(argv, work / model_type / "single")
        except Exception as exc:  # noqa: BLE001 - one line per cell
            cells[model_type] = dict.fromkeys(layouts, _refusal("", exc).replace(": ", ": one rank: ", 1))
            continue
        for layout in layouts:
            world, overrides = LAYOUTS[layout]
            tries = [overrides, [*overrides, NO_SP]] if layout == "fsdp2_tp2" else [overrides]
            for i, extra in enumerate(tries):
                try:
                    test = match_global_batch(argv, [*argv[:-1], *extra])[0]
                    path = _compose(test, work / model_type / layout)
                except Exception as exc:  # noqa: BLE001
                    cells[model_type][layout] = _refusal(layout, exc)
                    continue
                cells[model_type].pop(layout, None)
                jobs.setdefault(world, {})[f"{model_type}/{layout}"] = path
                if i:
                    notes[f"{model_type}/{layout}"] = " (no SP)"
                break
    runs = launch_jobs(work / "world1", world=1, alone={f"{t}/single": p for t, p in base.items()},
                       timeout=timeout)
    for world, ranks in sorted(jobs.items()):
        ranks = {n: p for n, p in ranks.items() if isinstance(runs.get(n.split("/")[0] + "/single"), list)}
        runs.update(launch_jobs(work / f"world{world}", world=world, ranks=ranks, timeout=timeout))
    for name in (n for r in jobs.values() for n in r):
        model_type, layout = name.split("/")
        one, got = runs.get(f"{model_type}/single"), runs.get(name)
        if isinstance(one, str):
            cells[model_type][layout] = f"error: one rank: {one.removeprefix('error: ')}"
        elif isinstance(got, str):
            cells[model_type][layout] = got + notes.get(name, "")
        elif got is None or len(got) != STEPS or len(one) != STEPS:
            cells[model_type][layout] = f"error: {len(got or [])} steps recorded, one rank {len(one or [])}"
        else:
            diff = max(abs(a - b) for a, b in zip(one, got, strict=True))
            ok = diff <= EQUAL  # NaN is not equal
            cells[model_type][layout] = ("equal" if ok else f"differ: {diff:.1e}") + notes.get(name, "")
    return {t: {x: c[x] for x in layouts} for t, c in cells.items()}
