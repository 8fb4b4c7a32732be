"""A tiny llama-style decoder registered as model ``tiny`` for the runtime tests.

Load it in ranks with ``TITAN_PLUGINS_EXTRA=tiny_plugin`` and ``tests/`` on
``PYTHONPATH`` (``titan_plugins.train.api.run(..., extra_plugins=["tiny_plugin"])``
does both). RMSNorm, GQA attention through SDPA with RoPE, SwiGLU; its
parallelize hook applies TP/SP -> AC -> compile -> FSDP with the core helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.spec import Capabilities, ModelSpec, PipelineInfo

_HERE = __name__


@dataclass(kw_only=True)
class TinyConfig:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 2048
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    fail_on_rank: int = -1  # tests: this rank raises in parallelize (-1: none)
    fail_user_error: bool = False  # raise a ConfigError instead of a crash


FLAVORS = {
    "debugmodel": TinyConfig(),
    "deep": TinyConfig(n_layers=8),
    "wide": TinyConfig(dim=128, hidden_dim=384, n_heads=8, n_kv_heads=4, max_seq_len=512),
}


@hookimpl
def titan_register_models(register: Any) -> None:
    register(
        ModelSpec(
            name="tiny",
            config=f"{_HERE}:TinyConfig",
            flavors=f"{_HERE}:FLAVORS",
            build=f"{_HERE}:build",
            parallelize=f"{_HERE}:parallelize",
            validate=f"{_HERE}:validate",
            flops=f"{_HERE}:flops",
            pipeline=PipelineInfo(),
            capabilities=Capabilities(fsdp=True, tp=True, pp=True),
            description="tiny llama-style decoder for the runtime tests",
        )
    )


def validate(config: TinyConfig, parallelism: Any) -> None:
    from titan_plugins.errors import ConfigError

    tp = parallelism.tp
    for key in ("n_heads", "n_kv_heads"):
        if getattr(config, key) % tp:
            raise ConfigError(f"model.{key}={getattr(config, key)} is not divisible by parallelism.tp={tp}")


def flops(config: TinyConfig, seq_len: int) -> tuple[int, int]:
    head_dim = config.dim // config.n_heads
    per_layer = (
        config.dim * head_dim * (config.n_heads * 2 + config.n_kv_heads * 2)
        + 3 * config.dim * config.hidden_dim
        + 2 * config.dim
    )
    params = config.n_layers * per_layer + 2 * config.vocab_size * config.dim + config.dim
    dense = params - config.vocab_size * config.dim  # the embedding is a lookup
    return params, 6 * dense + 12 * config.n_layers * config.n_heads * head_dim * seq_len


# ----------------------------------------------------------------- the model
PROBE_ENV = "TITAN_TINY_PROBE"  # tests: a folder where each rank writes what it started with


def build(config: TinyConfig):
    _write_probe()
    return _model_module().Transformer(config)


def _write_probe() -> None:
    import json
    import os

    folder = os.environ.get(PROBE_ENV)
    if folder:
        record = {"cwd": os.getcwd(), "pid": os.getpid(), "server": os.getppid(),
                  "failure_dir": os.environ.get("TITAN_FAILURE_DIR"), "rank": os.environ.get("RANK")}
        with open(os.path.join(folder, f"rank{record['rank']}.json"), "w") as f:
            json.dump(record, f)


_MODEL = None


def _model_module():
    """The nn.Module classes, defined on first use so registering imports no torch."""
    global _MODEL
    if _MODEL is not None:
        return _MODEL
    import types

    import torch
    import torch.nn.functional as F
    from torch import nn

    def precompute_freqs_cis(dim: int, end: int, theta: float, device=None) -> torch.Tensor:
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
        t = torch.arange(end, device=device, dtype=torch.float32)
        return torch.polar(torch.ones(end, dim // 2, device=device), torch.outer(t, freqs))

    def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        fc = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
        return torch.view_as_real(xc * fc).flatten(3).type_as(x)

    def cast(x, dtype):
        return x if dtype is None or x.dtype == dtype else x.to(dtype)

    def linear(x, module, dtype):
        if dtype is None:
            return module(x)
        return F.linear(cast(x, dtype), cast(module.weight, dtype))

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (out * self.weight.float()).type_as(x)

        def reset_parameters(self):
            nn.init.ones_(self.weight)

    class Attention(nn.Module):
        def __init__(self, cfg: TinyConfig):
            super().__init__()
            self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
            self.head_dim = cfg.dim // cfg.n_heads
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
            self.compute_dtype = None

        def forward(self, x, freqs_cis):
            bs, seqlen = x.shape[:2]
            dt = self.compute_dtype
            # -1 heads: under TP the projections return this rank's heads (local tensors;
            # SDPA on CPU has no DTensor strategy).
            q = linear(x, self.wq, dt).view(bs, seqlen, -1, self.head_dim)
            k = linear(x, self.wk, dt).view(bs, seqlen, -1, self.head_dim)
            v = linear(x, self.wv, dt).view(bs, seqlen, -1, self.head_dim)
            q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return linear(out.transpose(1, 2).reshape(bs, seqlen, -1), self.wo, dt)

    class FeedForward(nn.Module):
        def __init__(self, dim: int, hidden: int):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)
            self.compute_dtype = None

        def forward(self, x):
            dt = self.compute_dtype
            return linear(F.silu(linear(x, self.w1, dt)) * linear(x, self.w3, dt), self.w2, dt)

    class Block(nn.Module):
        def __init__(self, cfg: TinyConfig):
            super().__init__()
            self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.attention = Attention(cfg)
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

        def forward(self, x, freqs_cis):
            h = x + self.attention(self.attention_norm(x), freqs_cis)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, cfg: TinyConfig):
            super().__init__()
            self.config = cfg
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            self.compute_dtype = None
            self.register_buffer("freqs_cis", self._freqs(), persistent=False)

        def _freqs(self, device=None):
            cfg = self.config
            return precompute_freqs_cis(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device)

        def set_compute_dtype(self, dtype):
            self.compute_dtype = dtype
            for m in self.modules():
                if isinstance(m, Attention | FeedForward):
                    m.compute_dtype = dtype

        @torch.no_grad()
        def init_weights(self, buffer_device=None):
            device = buffer_device or self.freqs_cis.device
            self.freqs_cis = self._freqs(device)
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight)
            for block in self.layers.values():
                for m in block.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.trunc_normal_(m.weight, std=0.02)
                    elif isinstance(m, RMSNorm):
                        m.reset_parameters()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None:
                nn.init.trunc_normal_(self.output.weight, std=self.config.dim**-0.5)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
            h = cast(h, self.compute_dtype)
            for block in self.layers.values():
                h = block(h, self.freqs_cis)
            h = self.norm(h) if self.norm is not None else h
            return linear(h, self.output, self.compute_dtype) if self.output is not None else h

    _MODEL = types.SimpleNamespace(Transformer=Transformer)
    return _MODEL


# ------------------------------------------------------------- parallelize
def parallelize(model, parallel_dims, job_config):
    import torch.distributed as dist

    from titan_plugins.distributed.activation_checkpoint import apply_activation_checkpointing
    from titan_plugins.distributed.compile import apply_compile
    from titan_plugins.distributed.fsdp import apply_fsdp

    if model.config.fail_on_rank == dist.get_rank():
        if model.config.fail_user_error:
            from titan_plugins.errors import ConfigError

            raise ConfigError(f"tiny: injected user error on rank {dist.get_rank()}")
        raise RuntimeError(f"tiny: injected failure on rank {dist.get_rank()}")
    if parallel_dims.tp_enabled:
        _apply_tp(model, parallel_dims.mesh("tp"), job_config)
    apply_activation_checkpointing(model, job_config)
    apply_compile(model, job_config)
    apply_fsdp(model, parallel_dims, job_config)
    return model


def _apply_tp(model, tp_mesh, job_config) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = bool(job_config.parallelism.sequence_parallel)
    lp = bool(job_config.parallelism.loss_parallel)
    seq = Shard(1) if sp else Replicate()
    root: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        )
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            })
        parallelize_module(block, tp_mesh, plan)
