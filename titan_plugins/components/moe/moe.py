"""Mixture-of-experts layer (TorchTitan 0.2.2's ``MoE``: same names, buffers, numerics).

Parallelism is installed from outside by
``titan_plugins.distributed.expert_parallel.apply_moe_parallel``, which shards the
weights and sets ``moe.parallel``; ``forward`` then hands the layer boundary to it.
The math itself (``forward_tokens``) always runs on plain local tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_plugins.components.compute_dtype import cast
from titan_plugins.components.feed_forward import FeedForward
from titan_plugins.components.moe.config import MoEConfig, ScoreFunc
from titan_plugins.components.moe.experts import GroupedExperts
from titan_plugins.components.moe.router import TokenChoiceTopKRouter
from titan_plugins.components.moe.token_dispatch import (
    TOKEN_GROUP_ALIGN_SIZE_M,
    AllToAllTokenDispatcher,
    aligned_expert_permutation,
)


@dataclass
class LocalWeights:
    """The plain tensors ``forward_tokens`` computes with (local shards under TP)."""

    gate: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also sends ``grad_scale`` into ``aux_loss``, so the
    auxiliary loss joins whatever loss the output feeds without the trainer knowing."""

    @staticmethod
    def forward(ctx, out, aux_loss, grad_scale: float):
        ctx.grad_scale = grad_scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.grad_scale, dtype=torch.float32), None


class MoE(nn.Module):
    """Token-choice top-k MoE with optional shared experts and aux-loss-free balancing.

    ``forward(x: (batch, seq, dim)) -> (batch, seq, dim)``, in ``x``'s dtype.
    Buffers: ``expert_bias`` (persistent float32, only with ``load_balance_coeff``)
    and ``tokens_per_expert`` (non-persistent float32, accumulated every forward and
    consumed by ``build_load_balance_hooks``). With ``seq_aux_loss_coeff > 0`` the
    sequence-wise balance loss is added to the gradient through the output (its value
    is in ``aux_loss`` after each forward).
    """

    # forward_tokens reads these weights (local_weights), never calls the modules: LoRA leaves them
    lora_uncalled = ("router.gate", "shared_experts.w1", "shared_experts.w2", "shared_experts.w3")

    def __init__(
        self,
        config: MoEConfig,
        dim: int,
        hidden_dim: int,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        config.validate()
        num_experts = config.num_experts
        self.experts = GroupedExperts(
            dim, hidden_dim, num_experts, config.use_grouped_mm, compute_dtype
        )
        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=num_experts,
            num_expert_groups=config.num_expert_groups,
            num_limited_groups=config.num_limited_groups,
            top_k=config.top_k,
            score_func=config.score_func,
            route_norm=config.route_norm,
            route_scale=config.route_scale,
            compute_dtype=compute_dtype,
        )
        self.shared_experts = (
            FeedForward(dim, hidden_dim * config.num_shared_experts, compute_dtype)
            if config.num_shared_experts > 0
            else None
        )
        self.score_before_experts = config.score_before_experts
        self.compute_dtype = compute_dtype
        self.seq_aux_loss_coeff = config.seq_aux_loss_coeff
        self.aux_loss: torch.Tensor | None = None
        self.load_balance_coeff = config.load_balance_coeff
        if self.load_balance_coeff is not None:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True
            )
        else:
            self.expert_bias = None
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False
        )
        # Set by apply_moe_parallel: callable(moe, x) -> out handling the layer boundary.
        self.parallel: Callable[[MoE, torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel(self, x)
        bs, slen, dim = x.shape
        flat = x.reshape(-1, dim)
        return self.forward_tokens(flat, bs, self.local_weights()).view(bs, slen, dim)

    def local_weights(
        self, unwrap: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> LocalWeights:
        unwrap = unwrap or (lambda t: t)
        shared = None
        if self.shared_experts is not None:
            se = self.shared_experts
            shared = (unwrap(se.w1.weight), unwrap(se.w2.weight), unwrap(se.w3.weight))
        return LocalWeights(gate=unwrap(self.router.gate.weight), shared=shared)

    def forward_tokens(
        self,
        x: torch.Tensor,
        batch_size: int,
        weights: LocalWeights,
        dispatcher: AllToAllTokenDispatcher | None = None,
        token_group: torch.distributed.ProcessGroup | None = None,
        partial_grad_sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The MoE on local tokens ``x`` (``(tokens, dim)``); returns ``(tokens, dim)``
        in ``x``'s dtype.

        ``dispatcher`` moves rows to the ranks owning their experts and back.
        ``token_group``: the group whose ranks hold the other parts of these
        sequences (for the sequence-wise aux loss); None: the context-parallel peers
        under ``parallelism.cp``, else none. ``partial_grad_sync`` (tensor-
        parallel experts): identity whose backward sums gradients over the tp peers;
        applied to the experts' input and to the gating weights, whose gradients are
        partial sums there because the experts' outputs are; the experts get it too, for
        the LoRA adapter halves that stay whole over tp (``GroupedExperts.low_rank``).
        """
        num_tokens, dim = x.shape
        top_k = self.router.top_k
        scores = self.router.scores(x, weights.gate)
        top_scores, selected, counts = self.router.select(scores, self.expert_bias)
        x_experts = x
        if partial_grad_sync is not None:
            x_experts, top_scores = partial_grad_sync(x), partial_grad_sync(top_scores)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)

        # Rows sorted by expert (stable, like TorchTitan's TokenReorderer).
        order = torch.argsort(selected.view(-1), stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        routed_input = x_experts[order // top_k]
        if self.score_before_experts:
            scores_sorted = top_scores.view(-1)[order]
            routed_input = (routed_input.float() * scores_sorted.unsqueeze(1)).to(x.dtype)

        experts = self.experts
        if partial_grad_sync is not None:  # tensor-parallel experts: their LoRA adapters need it
            experts = functools.partial(self.experts, grad_sync=partial_grad_sync)
        if dispatcher is not None:
            rows, rows_per_expert, state = dispatcher.dispatch(routed_input, counts)
            routed_output = dispatcher.combine(experts(rows, rows_per_expert), state)
        elif self.experts.use_grouped_mm and x.is_cuda:
            # grouped GEMMs on GPU want aligned groups: pad each expert's rows.
            dest, padded, total = aligned_expert_permutation(
                counts.view(1, -1), TOKEN_GROUP_ALIGN_SIZE_M
            )
            rows = routed_input.new_zeros(total, dim).index_copy(0, dest, routed_input)
            routed_output = experts(rows, padded).index_select(0, dest)
        else:
            routed_output = experts(routed_input, counts)

        shared = None
        if weights.shared is not None:
            w1, w2, w3 = (cast(w, self.compute_dtype) for w in weights.shared)
            xs = cast(x_experts, self.compute_dtype)
            shared = F.linear(F.silu(F.linear(xs, w1)) * F.linear(xs, w3), w2)

        unsorted = routed_output[inverse].view(num_tokens, top_k, dim)
        if self.score_before_experts:
            out = unsorted.sum(dim=1)
        else:
            out = torch.bmm(top_scores.view(-1, 1, top_k), unsorted.float()).squeeze(1)
            out = out.to(routed_output.dtype)
        if shared is not None:
            out = shared + out
        out = out.to(x.dtype)

        if self.seq_aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            if token_group is None:  # context parallel: the peers holding the rest of these rows
                from titan_plugins.components.cp_attention import current_shard

                token_group = getattr(current_shard(), "group", None)
            aux, scale = self._seq_aux_loss(scores, selected, batch_size, token_group)
            self.aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux, scale)
        return out

    def _seq_aux_loss(
        self,
        scores: torch.Tensor,
        selected: torch.Tensor,
        batch_size: int,
        token_group: torch.distributed.ProcessGroup | None,
    ) -> tuple[torch.Tensor, float]:
        """DeepSeek-V3's sequence-wise balance loss, ``coeff * mean_b sum_i f_i P_i``.

        ``P_i``: mean over the sequence of the normalised scores; ``f_i``: the
        fraction of the sequence's top-k picks on expert ``i``, times ``E / top_k``.
        """
        num_experts, top_k = self.router.num_experts, self.router.top_k
        probs = scores.view(batch_size, -1, num_experts)
        if self.router.score_func is ScoreFunc.sigmoid:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        prob_sum = probs.sum(dim=1)
        with torch.no_grad():
            picks = torch.zeros_like(prob_sum).scatter_add_(
                1,
                selected.view(batch_size, -1),
                torch.ones_like(selected, dtype=prob_sum.dtype).view(batch_size, -1),
            )
            seq_len = torch.tensor([float(probs.shape[1])], device=probs.device)
        grad_scale = 1.0
        if token_group is not None:
            import torch.distributed.nn.functional as dist_nn

            prob_sum = dist_nn.all_reduce(prob_sum, group=token_group)
            torch.distributed.all_reduce(picks, group=token_group)
            torch.distributed.all_reduce(seq_len, group=token_group)
            # Every peer backpropagates the same loss; the all-reduce sums them.
            grad_scale = 1.0 / torch.distributed.get_world_size(token_group)
        frac = picks * (num_experts / (top_k * seq_len))
        aux = self.seq_aux_loss_coeff * (frac * prob_sum / seq_len).sum(dim=1).mean()
        return aux, grad_scale

    # --------------------------------------------------------------------- init
    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's scheme: experts (w1 std 0.02, w2/w3 ``init_std``), gate and
        shared experts with ``init_std`` (shared w1 0.02); buffers zeroed on
        ``buffer_device``."""
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device if buffer_device is not None else self.tokens_per_expert.device
        if device.type == "meta":
            return
        num_experts = self.experts.num_experts
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)
        if self.load_balance_coeff is not None:
            self.expert_bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
