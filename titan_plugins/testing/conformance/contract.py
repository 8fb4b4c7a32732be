"""What every check shares: the contracts, their error, what a check returns, and
the one-line renderings of exceptions and subprocess output. Imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import traceback

__all__ = ["CONTRACTS", "FIXES", "CheckResult", "ContractError", "last_json", "one_line", "tail", "where"]

# What a check returns: None when the contract holds, the reason when it does not
# apply to this model (e.g. TP is not declared). A broken contract raises.
CheckResult = str | None

# Contract name -> what it asks of a plugin (docs/writing-a-plugin.md explains each).
CONTRACTS = {
    "registration": "the model is registered through the 'titan_plugins' entry point, with a TITAN_PLUGINS_API range",
    "plugin-import": "the plugin module, its schema and flavors import without torch",
    "schema": "the config schema is an OmegaConf-compatible dataclass and every flavor is an instance of it",
    "hydra-compose": "every flavor composes through Hydra as model=<name> model.flavor=<flavor>",
    "typed-override": "a wrongly typed or unknown model.* override is rejected, naming the key",
    "meta-build": "build(config) works under torch.device('meta') and the model has init_weights(buffer_device)",
    "init-weights": "init_weights initialises every parameter and buffer, deterministically for a seed",
    "forward-backward": "forward(tokens) returns [B, S, V] logits; backward gives finite gradients to every parameter",
    "state-dict": "state_dict() holds learned state only: derived buffers (rotary caches) are non-persistent",
    "parallelize-fsdp": "the parallelize hook shards the model with FSDP2 (apply_fsdp)",
    "parallelize-tp": "the parallelize hook applies a TP plan that resolves, leaving buffers plain tensors",
    "parallelize-ep": "the parallelize hook shards the experts over the ep mesh",
    "parallelize-pp": "the parallelize hook runs per pipeline stage, where stage-local modules are None",
    "pipeline-split": "split by PipelineInfo, each stage initialises and runs, and the stages chained give the model's logits",
    "loss-parity": "a 2-rank gloo run (fsdp, tp, ep) matches the single-rank loss within LOSS_PARITY",
    "hf-round-trip": "the adapter's from_hf(to_hf(state_dict())) is the state dict exactly, and config.json maps both ways",
    "hf-transformers": "where transformers knows the architecture: config.json reads back through its config class, "
    "and a random transformers model loads with its logits and exports back strictly",
    "generation": "with cache= in forward, cached and uncached greedy decoding give the same tokens",
}

# How to fix a broken parallelize contract (the fake-process-group probe reports them).
FIXES = {
    "parallelize-fsdp": "call titan_plugins.distributed.fsdp.apply_fsdp(model, parallel_dims, job_config) "
    "last in the hook; it wraps each block, skips None modules and is a no-op without data parallelism",
    "parallelize-tp": "build the plan with titan_plugins.distributed.tensor_parallel (apply_tp_plan, "
    "root_plan, colwise, rowwise, norm_style, gather_input, LocalAttention); keys must name modules "
    "that exist, and buffers stay plain tensors (replicate them per call with gather_input/replicate_like)",
    "parallelize-ep": "shard the experts with titan_plugins.distributed.expert_parallel on "
    "parallel_dims.mesh('ep') and pass experts_attr= to apply_fsdp",
    "parallelize-pp": "the hook runs once per pipeline stage and modules the stage does not own "
    "(PipelineInfo.first_stage_modules / last_stage_modules) are None there: use apply_tp_plan, "
    "owned_blocks and apply_fsdp (which skip them) and guard direct access with `if model.x is not None`",
}


class ContractError(AssertionError):
    """A contract a plugin breaks: ``"<contract>: <what is wrong>. Fix: <how>"``."""

    def __init__(self, contract: str, problem: str, fix: str):
        self.contract, self.problem, self.fix = contract, problem.rstrip("."), fix.rstrip(".")
        super().__init__(f"{contract}: {self.problem}. Fix: {self.fix}.")


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame outside torch and the core (the plugin's)."""
    import titan_plugins

    core = os.path.dirname(titan_plugins.__file__)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = frame.filename
        if f"{os.sep}torch{os.sep}" in path or path.startswith(core) or path.startswith("<"):
            continue
        parts = path.split(os.sep)
        return f" (at {os.sep.join(parts[-2:]) if len(parts) > 1 else path}:{frame.lineno})"
    return ""


def last_json(proc: subprocess.CompletedProcess) -> dict | None:
    """The JSON object a probe printed as its last ``{...}`` line of stdout."""
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def tail(text: str, n: int = 3) -> str:
    """The last ``n`` non-empty lines of ``text`` joined with `` | ``."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "no output"
