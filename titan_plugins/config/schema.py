"""Structured schemas for every config group except ``model`` (each plugin brings
its own). Hydra validates overrides against them, so ``training.steps=abc`` fails
with a typed error naming the key. Only Enums, no Literal or Callable fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from titan_plugins.peft.config import PeftConfig


def ranged(default: Any, interval: str) -> Any:
    """A numeric field with the values it may take, in interval notation
    (``"[1, inf)"``, ``"(0, 1]"``); ``titan_plugins.train.prelaunch.check_ranges``
    checks every such field before any rank starts (None, where allowed, passes).
    The one place a range is declared: add it here, not as a check elsewhere."""
    return field(default=default, metadata={"range": interval})


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


class NonFinite(str, Enum):
    """training.nonfinite: what a NaN/Inf loss or gradient norm does (train/nonfinite.py)."""

    stop = "stop"  # end the run before the optimizer step, one line naming step and rank
    skip = "skip"  # drop that optimizer step on every rank (counted in the summary)


class SaveSignal(str, Enum):
    """checkpoint.on_signal: the signal on which the ranks save and exit 75 (preempted)."""

    USR1 = "USR1"
    USR2 = "USR2"
    TERM = "TERM"


@dataclass
class ParallelismConfig:
    """Degrees: dp_replicate x dp_shard x cp x tp x pp = world size.

    EP borrows from dp_shard x tp: with ``etp=1`` it spans ``ep/tp`` dp_shard ranks
    and all of tp; with ``etp=tp`` it spans ``ep`` dp_shard ranks.
    ``cp``: context parallel, each row's sequence split over ``cp`` ranks in
    ``2 * cp`` load-balanced chunks (titan_plugins/distributed/context_parallel.py).
    ``dp_shard=-1`` fills what the world size leaves (torchrun/Slurm or ``world_size``).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
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
    pp_microbatches: int | None = ranged(None, "[1, inf)")  # default: the number of stages
    pp_stages_per_rank: int = ranged(1, "[1, inf)")  # >1 for interleaved schedules
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
    steps: int = ranged(60, "[1, inf)")
    seed: int = 0
    deterministic: bool = False
    local_batch_size: int = ranged(4, "[1, inf)")  # sequences per data-parallel rank per microbatch
    grad_accum_steps: int = ranged(1, "[1, inf)")
    seq_len: int = ranged(128, "[1, inf)")
    lr: float = ranged(3e-3, "(0, inf)")
    min_lr_ratio: float = ranged(0.1, "[0, 1]")
    warmup_steps: int = ranged(5, "[0, inf)")
    decay: LRDecay = LRDecay.cosine
    weight_decay: float = ranged(0.1, "[0, inf)")
    beta1: float = ranged(0.9, "[0, 1)")
    beta2: float = ranged(0.95, "[0, 1)")
    eps: float = ranged(1e-8, "(0, inf)")
    max_norm: float = ranged(1.0, "(0, inf)")
    activation_checkpoint: ActivationCheckpoint = ActivationCheckpoint.none
    selective_every: int = ranged(2, "[1, inf)")
    compile: bool = False
    dump_final_params: bool = False  # rank 0 writes <run_dir>/final_params.pt (full tensors)
    nonfinite: NonFinite = NonFinite.stop  # a NaN/Inf loss or grad norm on any rank: stop | skip
    nonfinite_max_skips: int = ranged(5, "[1, inf)")  # skip: steps skipped in a row before one more stops the run
    # Positions per chunk of the fused head + cross-entropy (loss/fused.py): the full
    # logits and their gradient are never held; 0: the plain head and whole logits.
    loss_chunk_size: int = ranged(256, "[0, inf)")


@dataclass
class ChatDataConfig:
    """``data.name=chat`` (titan_plugins/data/chat_source.py)."""

    format: str = "auto"  # auto | messages | sharegpt | instruction | prompt_completion
    messages_field: str | None = None  # default: messages (conversations for sharegpt)
    system_field: str = "system"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    template: str | None = None  # a .jinja file or a shipped name (chatml); default: the tokenizer folder's
    train_on: str = "assistant"  # assistant | last_assistant | all: the tokens the loss counts
    pack: bool = True  # several conversations per row (block-causal); false: one per row, padded
    overlong: str = "truncate"  # a conversation over seq_len: truncate (keep its start) | drop


@dataclass
class PreferenceDataConfig:
    """``data.name=preference`` (titan_plugins/data/preference_source.py): TRL's
    preference rows, conversational (``prompt`` messages + ``chosen``/``rejected``
    assistant messages) or implicit-prompt (``chosen``/``rejected`` whole conversations
    sharing their prompt)."""

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    template: str | None = None  # as data.chat.template: a .jinja file or a shipped name; default the tokenizer's
    max_prompt_length: int | None = ranged(None, "[1, inf)")  # prompt tokens kept (None: no limit)
    max_completion_length: int | None = ranged(None, "[1, inf)")  # completion tokens kept (None: no limit)
    truncation_mode: str = "keep_end"  # keep_end: a long prompt loses its start | keep_start: its end
    overlong: str = "truncate"  # a pair over training.seq_len: truncate (the completion's end) | drop | error


@dataclass
class PromptDataConfig:
    """``data.name=prompts`` (titan_plugins/data/prompt_source.py): TRL's prompt-only rows
    for online objectives; every other column goes to the reward functions."""

    prompt_field: str = "prompt"
    template: str | None = None  # as data.chat.template: a .jinja file or a shipped name; default the tokenizer's


@dataclass
class DataConfig:
    name: str = "builtin"  # a registered dataset: builtin, synthetic, text, jsonl, parquet, hf, mix
    path: str | None = None  # file, directory or local dataset for text/jsonl/hf
    text_field: str = "text"
    split: str = "train"
    tokenizer: str | None = None  # a tokenizer.json; default: the shipped one
    vocab_size: int | None = ranged(None, "[1, inf)")  # synthetic data only: default the tokenizer's
    num_workers: int = ranged(1, "[0, inf)")  # loader worker processes per rank (streaming sources); 0: in the rank
    prefetch_factor: int = ranged(2, "[1, inf)")  # batches each worker prepares ahead
    mix: list[Any] = field(default_factory=list)  # data.name=mix: [{name, path, weight}, ...]
    chat: ChatDataConfig = field(default_factory=ChatDataConfig)  # data.name=chat
    preference: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # data.name=preference
    prompts: PromptDataConfig = field(default_factory=PromptDataConfig)  # data.name=prompts


@dataclass
class CheckpointConfig:
    enabled: bool = False
    folder: str = "checkpoints"  # relative to the run directory
    interval: int = ranged(50, "[1, inf)")  # steps between saves (the last step is saved too)
    keep_last: int = ranged(2, "[0, inf)")  # 0: keep every checkpoint
    resume: bool = True  # resume from the newest checkpoint in folder if any
    init_from: str | None = None  # a seed checkpoint (model weights only)
    save_final: bool = True
    create_seed: bool = False  # build + init_weights on one rank, save model weights, exit
    export_hf: bool = False  # at the end, write a Hugging Face folder to <run_dir>/hf (titan-export)
    # On this signal the ranks save at the next step boundary and the job exits 75
    # ("preempted, resume me"; docs/running.md, Faults and resuming). None: off.
    on_signal: SaveSignal | None = None


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
    log_freq: int = ranged(1, "[1, inf)")
    jsonl: bool = True
    tensorboard: bool = True
    peak_tflops: float | None = ranged(None, "(0, inf)")  # per device, for MFU; default per device type
    console: bool = True  # the rank-0 log line per step, the run header and summary
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfilingConfig:
    """torch.profiler traces of ``steps`` steps from ``start_step`` into
    ``<run_dir>/profile`` (titan_plugins/train/profiling.py)."""

    enabled: bool = False
    start_step: int = ranged(3, "[1, inf)")  # the first traced step (counting from 1); earlier steps warm up
    steps: int = ranged(2, "[1, inf)")  # how many steps to trace
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
    device_memory_gb: float = ranged(80.0, "(0, inf)")
    json: bool = False


@dataclass
class ValidationConfig:
    """Held-out loss every ``every`` steps (titan_plugins/train/validation.py)."""

    enabled: bool = False
    every: int = ranged(50, "[1, inf)")  # steps between validations (and after the last step)
    steps: int = ranged(4, "[1, inf)")  # batches of training.local_batch_size rows per rank, each time
    split: str = "validation"  # of the data source (builtin: its held-out 5%)
    name: str | None = None  # another dataset for validation (default: data.name)
    path: str | None = None  # the held-out file or folder (text/jsonl/parquet need it)


@dataclass
class ObjectiveConfig:
    """``objective=<name>`` (titan_plugins/objectives): what the train step minimises.
    The knobs of the DPO family are named as TRL's DPOConfig/CPOConfig/ORPOConfig name
    them; a third-party objective reads its own from ``options``."""

    name: str = "sft"  # sft | dpo | grpo | an installed objective (titan-plugins list)
    # dpo: sigmoid | ipo | hinge | robust | simpo | orpo; grpo: grpo | dapo | dr_grpo | bnpo
    loss_type: str = "sigmoid"
    # the KL weight (dpo: above 0; simpo: the reward scale; orpo: the odds-ratio weight; grpo: 0 = no reference)
    beta: float = ranged(0.1, "[0, inf)")
    label_smoothing: float = ranged(0.0, "[0, 0.5)")  # robust: the assumed share of flipped labels
    simpo_gamma: float = ranged(0.5, "[0, inf)")  # simpo: the target reward margin
    # dpo with a reference: its log-probs computed from the starting weights in a first pass and
    # stored in the run directory (no frozen copy under full fine-tuning)
    precompute_ref: bool = False
    # grpo (titan_plugins/objectives/grpo.py), named as TRL's GRPOConfig names them
    num_generations: int = ranged(8, "[2, inf)")  # completions sampled per prompt (a group)
    max_completion_length: int = ranged(64, "[1, inf)")  # new tokens per completion at most
    temperature: float = ranged(1.0, "(0, inf)")  # sampling, and every log-prob and entropy of the loss
    top_p: float = ranged(1.0, "(0, 1]")
    top_k: int = ranged(0, "[0, inf)")  # 0: off
    epsilon: float = ranged(0.2, "[0, inf)")  # the clip range's lower side (and upper, without epsilon_high)
    epsilon_high: float | None = ranged(None, "[0, inf)")  # DAPO's asymmetric upper side
    scale_rewards: str = "group"  # group | batch | none: what the advantages are divided by
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    num_iterations: int = ranged(1, "[1, inf)")  # policy updates per generation batch (old log-probs kept)
    mask_truncated_completions: bool = False  # completions ending in neither EOS nor padding train nothing
    use_bias_correction_kl: bool = True  # beta > 0: the KL term weighted by the importance ratio (TRL's default)
    reward_funcs: list[str] = field(default_factory=list)  # rewards (titan_plugins.rewards entry points)
    reward_weights: list[float] | None = None  # one per reward (None: all 1.0)
    reward_options: dict[str, Any] = field(default_factory=dict)  # {reward: {keyword: value}}
    options: dict[str, Any] = field(default_factory=dict)  # a third-party objective's own knobs


@dataclass
class VLLMRolloutConfig:
    """``rollout=vllm``: one in-process vLLM engine per training rank, on its GPU
    (titan_plugins/objectives/rollout_vllm.py)."""

    gpu_memory_utilization: float = ranged(0.3, "(0, 1]")  # the GPU's share vLLM takes (weights + KV cache)
    bucket_mb: int = ranged(512, "[1, inf)")  # largest weight push (MiB): the update's extra memory
    enable_sleep_mode: bool = True  # vLLM's GPU memory freed while the step trains (sleep / wake_up)
    dtype: str = "auto"  # vLLM's weights and compute (auto: config.json's torch_dtype)
    enforce_eager: bool = False  # no CUDA graphs (less memory and start-up time, slower decoding)


@dataclass
class RolloutConfig:
    """``rollout=<engine>`` with ``objective=grpo``: where the completions come from
    (titan_plugins/objectives/rollout.py). ``native``: sampled from the live policy with
    the KV cache; ``file``: replayed from ``path`` (JSONL); ``vllm``: sampled by vLLM
    colocated with training (GPU only), the weights pushed after each update."""

    name: str = "native"  # native | file | vllm
    path: str | None = None  # file: the JSONL of completions (and rewards) to replay
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)  # vllm: the engine's knobs


@dataclass
class FaultToleranceConfig:
    """``fault_tolerance=torchft``: the job runs as ``replica_groups`` replica groups of
    ``group_size`` ranks each (the parallelism preset lays out one group); torchft's
    Manager sums the gradients of the groups alive at each step, and a group that dies
    is dropped from the quorum, restarted and healed from a live peer
    (titan_plugins/distributed/fault_tolerance.py, ft_supervisor.py)."""

    enable: bool = False
    replica_groups: int = ranged(2, "[1, inf)")  # M: groups that train side by side
    group_size: int | None = ranged(None, "[1, inf)")  # ranks per group (None: the preset's world size)
    min_replicas: int = ranged(1, "[1, inf)")  # a step commits only with at least this many groups
    lighthouse: str | None = None  # None: titan-run starts one; host:port: a shared one
    max_restarts: int = ranged(3, "[0, inf)")  # per group: how often titan-run restarts a lost group
    quorum_timeout_s: float = ranged(120.0, "(0, inf)")  # the longest wait for a quorum
    timeout_s: float = ranged(60.0, "(0, inf)")  # cross-group collectives, commits and healing transfers
    heartbeat_timeout_s: float = ranged(5.0, "(0, inf)")  # the started lighthouse: silence that means dead
    join_timeout_s: float = ranged(60.0, "(0, inf)")  # the started lighthouse: wait for a healthy straggler
    replica_id: int | None = ranged(None, "[0, inf)")  # set per group by titan-run (by hand under torchrun)


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
    peft: PeftConfig = field(default_factory=PeftConfig)  # peft=lora: titan_plugins/peft
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # objective=dpo: titan_plugins/objectives
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # objective=grpo's completions
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)  # replica groups (torchft)
    run_dir: str = "."  # set by titan-run to Hydra's output directory
