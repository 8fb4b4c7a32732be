"""Structured schemas for every config group except ``model`` (each plugin brings
its own). Hydra validates overrides against them, so ``training.steps=abc`` fails
with a typed error naming the key. Only Enums, no Literal or Callable fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Float8Recipe(str, Enum):
    """torchao float8 training scales (titan_plugins/distributed/float8.py)."""

    tensorwise = "tensorwise"  # one scale per tensor; FSDP all-gathers weights in float8
    rowwise = "rowwise"  # one scale per row: more accurate, bf16 all-gathers


class ReshardAfterForward(str, Enum):
    default = "default"  # reshard every block except the last (torchtitan's choice)
    always = "always"
    never = "never"


class ActivationCheckpoint(str, Enum):
    none = "none"
    selective = "selective"  # every `selective_every`-th block
    full = "full"


class LRDecay(str, Enum):
    none = "none"
    linear = "linear"
    cosine = "cosine"


@dataclass
class ParallelismConfig:
    """Degrees: dp_replicate x dp_shard x tp x pp = world size.

    EP borrows from dp_shard x tp: with ``etp=1`` it spans ``ep/tp`` dp_shard ranks
    and all of tp; with ``etp=tp`` it spans ``ep`` dp_shard ranks.
    ``dp_shard=-1`` fills what the world size leaves (torchrun/Slurm or ``world_size``).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int | None = None  # only needed with dp_shard=-1 outside torchrun
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # GPipe | 1F1B | Interleaved1F1B. A str, not an Enum: an Enum member cannot be
    # named "1F1B", and users type the schedule's real name. Checked before launch.
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # default: the number of stages
    pp_stages_per_rank: int = 1  # >1 for interleaved schedules
    fsdp_reshard_after_forward: ReshardAfterForward = ReshardAfterForward.default
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "auto"  # auto | gloo | nccl


@dataclass
class PrecisionConfig:
    """``param_dtype``/``reduce_dtype`` drive FSDP's MixedPrecisionPolicy;
    ``compute_dtype`` (if set) makes the model compute in that dtype while its
    weights and optimizer state stay in ``weight_dtype``."""

    name: str = "fp32"
    weight_dtype: Dtype = Dtype.float32
    param_dtype: Dtype = Dtype.float32
    reduce_dtype: Dtype = Dtype.float32
    compute_dtype: Dtype | None = None
    float8: Float8Recipe | None = None  # torchao float8 linears (CUDA, SM 8.9+); checked before launch


@dataclass
class TrainingConfig:
    steps: int = 60
    seed: int = 0
    deterministic: bool = False
    local_batch_size: int = 4  # sequences per data-parallel rank per microbatch
    grad_accum_steps: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    decay: LRDecay = LRDecay.cosine
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_norm: float = 1.0
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    selective_every: int = 2
    compile: bool = False
    dump_final_params: bool = False  # rank 0 writes <run_dir>/final_params.pt (full tensors)


@dataclass
class DataConfig:
    name: str = "builtin"  # a registered dataset: builtin, synthetic, text, jsonl, parquet, hf, mix
    path: str | None = None  # file, directory or local dataset for text/jsonl/hf
    text_field: str = "text"
    split: str = "train"
    tokenizer: str | None = None  # a tokenizer.json; default: the shipped one
    vocab_size: int | None = None  # synthetic data only: default the tokenizer's
    num_workers: int = 1  # loader worker processes per rank (streaming sources); 0: in the rank
    prefetch_factor: int = 2  # batches each worker prepares ahead
    mix: list[Any] = field(default_factory=list)  # data.name=mix: [{name, path, weight}, ...]


@dataclass
class CheckpointConfig:
    enabled: bool = False
    folder: str = "checkpoints"  # relative to the run directory
    interval: int = 50
    keep_last: int = 2
    resume: bool = True  # resume from the newest checkpoint in folder if any
    init_from: str | None = None  # a seed checkpoint (model weights only)
    save_final: bool = True
    create_seed: bool = False  # build + init_weights on one rank, save model weights, exit
    export_hf: bool = False  # at the end, write a Hugging Face folder to <run_dir>/hf (titan-export)


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"  # written under dir, uploaded later with `wandb sync`


@dataclass
class MLflowConfig:
    """The MLflow sink (``pip install 'titan-plugins[mlflow]'``), rank 0 only."""

    enabled: bool = False
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else file:<run_dir>/mlruns
    experiment: str = "titan-plugins"
    run_name: str | None = None  # default: <model>-<flavor>-<run dir name>


@dataclass
class WandbConfig:
    """The Weights & Biases sink (``pip install 'titan-plugins[wandb]'``), rank 0 only."""

    enabled: bool = False
    project: str = "titan-plugins"
    entity: str | None = None
    mode: WandbMode = WandbMode.online
    dir: str | None = None  # default: the run directory
    run_name: str | None = None  # default: <model>-<flavor>-<run dir name>


@dataclass
class MetricsConfig:
    log_freq: int = 1
    jsonl: bool = True
    tensorboard: bool = True
    peak_tflops: float | None = None  # per device, for MFU; default per device type
    console: bool = True  # the rank-0 log line per step, the run header and summary
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfilingConfig:
    """torch.profiler traces of ``steps`` steps from ``start_step`` into
    ``<run_dir>/profile`` (titan_plugins/train/profiling.py)."""

    enabled: bool = False
    start_step: int = 3  # the first traced step (counting from 1); earlier steps warm up
    steps: int = 2  # how many steps to trace
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = False  # CUDA: allocator history, dumped after the traced steps and on OOM


@dataclass
class PlanConfig:
    # The planned world is parallelism.world_size (one key for a plan and a run);
    # ``plan.world_size=N`` on the command line is read as that key (config/compose.py).
    enabled: bool = False
    ranks: list[int] | None = None  # default: rank 0 and the first rank of the last stage
    device_memory_gb: float = 80.0
    json: bool = False


@dataclass
class ValidationConfig:
    """Held-out loss every ``every`` steps (titan_plugins/train/validation.py)."""

    enabled: bool = False
    every: int = 50  # steps between validations (and after the last step)
    steps: int = 4  # batches of training.local_batch_size rows per rank, each time
    split: str = "validation"  # of the data source (builtin: its held-out 5%)
    name: str | None = None  # another dataset for validation (default: data.name)
    path: str | None = None  # the held-out file or folder (text/jsonl/parquet need it)


@dataclass
class JobConfig:
    model: Any = MISSING
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    run_dir: str = "."  # set by titan-run to Hydra's output directory
