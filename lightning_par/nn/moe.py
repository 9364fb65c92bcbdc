"""A mixture-of-experts feed-forward layer that runs on one device and that the ``moe`` strategies shard.

Routing (Shazeer et al. 2017, arXiv 1701.06538; GShard, arXiv 2006.16668; Switch, arXiv 2101.03961): a linear
router scores each token against ``E`` experts, the ``top_k`` best experts process it, and their outputs are
summed weighted by the router probabilities (renormalised over the chosen ``k`` when ``normalize_gates``).

Capacity. With ``capacity_factor=cf`` each expert takes at most ``C = ceil(cf * N * k / E)`` token assignments,
where ``N`` is the number of tokens of the *whole batch the layer sees*: one device's batch, or, under a strategy,
the global batch over all data-parallel ranks (`MoE.token_group`). When more than ``C`` assignments want expert
``e``, the ones kept are those whose router probability for ``e`` is strictly greater than the ``(C+1)``-th largest
such probability (Batch Prioritized Routing, Riquelme et al. 2021, arXiv 2106.05974). The rule depends only on the
set of scores, never on the order of tokens, so splitting the batch over ranks in any order drops exactly the
tokens one device would drop; exact ties at the boundary are all dropped (so never more than ``C`` are kept). A
dropped assignment contributes nothing (the block's residual connection carries the token). ``capacity_factor=None``
is dropless: every assignment is computed.

Auxiliary losses, kept on the layer after each forward (add them to the loss in ``training_step``; `moe_loss`
sums them over a model):

- ``aux_loss``: the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
  ``N * k`` assignments routed to ``e`` (before capacity) and ``P_e`` the mean router probability of ``e``; it is
  1.0 for perfectly uniform routing. ``f_e`` (not differentiable) is counted over the whole batch (token group);
  ``P_e`` is this rank's mean (under context parallelism, over the tokens of its samples on every cp rank), so
  the data-parallel mean of the per-rank losses and of their gradients is the one-device value.
- ``z_loss``: the router z-loss of ST-MoE (Zoph et al. 2022, arXiv 2202.08906), ``mean_t logsumexp(logits_t)^2``.

Options: ``router_jitter`` multiplies the router input by noise ``U(1 - eps, 1 + eps)`` in training (Switch);
``expert_bias`` adds a non-learned per-expert bias to the scores used to *choose* experts, not to the gate weights
(the auxiliary-loss-free balancing of DeepSeek-V3, arXiv 2412.19437): update it with `MoE.update_expert_bias`.

Expert weights are stacked parameters ``w1: [E, d, f]``, ``w2: [E, f, d]`` (and ``w3`` for gated activations)
rather than a ``ModuleList`` of experts: expert parallelism then keeps rows ``[r*E/ep, (r+1)*E/ep)`` of the same
parameters under the same names (so checkpoints and optimizer state are keyed identically in every layout), and
the experts module sees a contiguous slice with no renumbering.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}


class Experts(nn.Module):
    """``E`` two-layer feed-forward experts as stacked weights, run on tokens already grouped by expert.

    Args:
        n_experts: experts held here (all of them on one device; ``E/ep`` under expert parallelism).
        d_model: model width.
        d_ff: hidden width of each expert.
        activation: ``"gelu"``, ``"silu"`` or ``"relu"``.
        gated: a gated (GLU) expert ``w2(act(x w1) * (x w3))``, e.g. SwiGLU with ``activation="silu"``.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, activation: str = "gelu", gated: bool = False) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is unknown; choose one of {sorted(_ACTIVATIONS)}")
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_ff)) if gated else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert initialised like an ``nn.Linear`` of its shape (uniform, bound ``1/sqrt(fan_in)``)."""
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                bound = 1.0 / math.sqrt(w.shape[1])
                nn.init.uniform_(w, -bound, bound)

    def forward(self, x: Tensor, counts: Union[Tensor, list[int]]) -> Tensor:
        """Run expert ``e`` on its rows of ``x``.

        Args:
            x: ``[M, d]`` rows grouped by expert: the first ``counts[0]`` rows go to expert 0, and so on.
            counts: ``[n_experts]`` rows per expert: a tensor (read to the host here: one device sync), or a list
                when the caller already holds them on the host (expert parallelism's dispatch).

        Returns:
            ``[M, d]`` outputs in the same order.
        """
        act = _ACTIVATIONS[self.activation]
        # Compute in the tokens' dtype: under ZeRO-3 mixed precision FSDP2 casts the other weights to bf16 but
        # leaves expert shards (which it ignores) in fp32. A no-op when the dtypes already agree.
        w1, w2 = self.w1.to(x.dtype), self.w2.to(x.dtype)
        w3 = self.w3.to(x.dtype) if self.w3 is not None else None
        outs = []
        # A loop of dense matmuls: E is small, and an empty expert costs nothing. (A grouped GEMM would fuse it.)
        for e, rows in enumerate(x.split(counts if isinstance(counts, list) else counts.tolist())):
            h = act(rows @ w1[e])
            if w3 is not None:
                h = h * (rows @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs) if outs else x.new_empty(0, w2.shape[-1])


class _SumOver(torch.autograd.Function):
    """All-reduce (sum) with autograd: backward sums the upstream gradients too. Every rank of the group computes
    the same loss from the sum, so each gets ``group size x`` its own rows' part, which the strategy's average
    over those ranks (context parallelism: dp x cp) turns into the exact gradient."""

    @staticmethod
    def forward(ctx: object, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # type: ignore[attr-defined]
        return grad, None


class MoE(nn.Module):
    """Drop-in mixture-of-experts replacement for a transformer block's feed-forward layer.

    ``forward(x)`` maps ``[..., d_model]`` to the same shape. After each forward the layer holds ``aux_loss`` and
    ``z_loss`` (unweighted scalars with gradients; `loss` weights them by ``aux_loss_coef`` / ``z_loss_coef``)
    and ``stats`` (detached: ``tokens_per_expert`` and ``dropped_fraction`` of assignments over the whole batch;
    ``expert_index`` and ``kept``, ``[N, k]``, for this rank's tokens).

    Args:
        d_model: model width.
        d_ff: hidden width of each expert.
        n_experts: number of experts ``E``.
        top_k: experts per token (1 = Switch, 2 = GShard / Mixtral); ``1 <= top_k <= n_experts``.
        capacity_factor: ``> 0``; assignments per expert are capped at ``ceil(cf * N * k / E)`` over the whole
            batch (see the module docstring). ``None``: dropless.
        activation: expert activation, ``"gelu"``, ``"silu"`` or ``"relu"``.
        gated: gated experts (SwiGLU with ``activation="silu"``).
        normalize_gates: renormalise the chosen ``k`` probabilities to sum to 1 (Mixtral); default: ``top_k > 1``.
        aux_loss_coef: weight of ``aux_loss`` in `loss` (Switch uses 0.01).
        z_loss_coef: weight of ``z_loss`` in `loss` (ST-MoE uses 0.001).
        router_jitter: ``eps`` of the multiplicative router-input noise in training; 0 disables it.
        expert_bias: keep a per-expert selection bias buffer (aux-loss-free balancing); see `update_expert_bias`.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: Optional[float] = None,
        activation: str = "gelu",
        gated: bool = False,
        normalize_gates: Optional[bool] = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        router_jitter: float = 0.0,
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"n_experts={n_experts} must be >= 1")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in 1..n_experts={n_experts}; choose top_k in 1..{n_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={capacity_factor} must be > 0 (1.0-1.25 is typical), or None for dropless routing"
            )
        if not 0 <= router_jitter < 1:
            raise ValueError(f"router_jitter={router_jitter} must be in [0, 1) (Switch uses 0.01)")
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.normalize_gates = top_k > 1 if normalize_gates is None else normalize_gates
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.router_jitter = router_jitter
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, d_ff, activation, gated)
        self.expert_bias: Optional[Tensor]
        self.register_buffer("expert_bias", torch.zeros(n_experts) if expert_bias else None)
        # The ranks whose tokens form one batch for capacity and the load-balancing statistics. Set by the
        # strategy to the data-parallel group; None = this device's tokens only.
        self.token_group: Optional[dist.ProcessGroup] = None
        # Under context parallelism: the ranks holding chunks of the same samples; the per-rank means of the
        # auxiliary losses (P_e, the z-loss) are then taken over their tokens together, as one device would.
        self.sample_group: Optional[dist.ProcessGroup] = None
        self.aux_loss: Tensor = torch.zeros(())
        self.z_loss: Tensor = torch.zeros(())
        self.stats: dict[str, Tensor] = {}

    def capacity(self, n_tokens: int) -> int:
        """Assignments one expert may take for a batch of ``n_tokens`` tokens (the whole batch, all ranks)."""
        if self.capacity_factor is None:
            return n_tokens * self.top_k
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def loss(self) -> Tensor:
        """``aux_loss_coef * aux_loss + z_loss_coef * z_loss`` of the last forward."""
        return self.aux_loss_coef * self.aux_loss + self.z_loss_coef * self.z_loss

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3's bias update: raise the selection bias of under-loaded experts, lower over-loaded ones.

        Args:
            tokens_per_expert: ``[E]`` assignments per expert over the whole batch (``stats["tokens_per_expert"]``
                is already summed over the token group, so every rank applies the same update).
            rate: the step ``gamma`` of ``bias += gamma * sign(mean_load - load)``.
        """
        if self.expert_bias is None:
            raise RuntimeError("this MoE was built with expert_bias=False; pass expert_bias=True to use the bias")
        load = tokens_per_expert.float().to(self.expert_bias.device)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.token_group is not None:
            dist.all_reduce(t, group=self.token_group)
        return t

    def _sample_means(self, rows: Tensor) -> Tensor:
        """Column means of ``rows`` over this rank's tokens, or over the sample group's (autograd included);
        zeros with a gradient path when there are no tokens."""
        total = torch.cat([rows.sum(0), rows.new_full((1,), rows.shape[0])])  # new_full: no host->device copy
        if self.sample_group is not None and dist.get_world_size(self.sample_group) > 1:
            total = _SumOver.apply(total, self.sample_group)
        return total[:-1] / total[-1].detach().clamp(min=1)

    @torch.no_grad()
    def _keep_mask(self, priority: Tensor, chosen: Tensor, n_global: int) -> Tensor:
        """Capacity: keep an assignment iff its priority beats the (C+1)-th best of its expert batch-wide."""
        cap = self.capacity(n_global)
        n = priority.shape[0]
        scores = priority.new_full((max(n, cap + 1), self.n_experts), -math.inf)
        scores[:n].scatter_(1, chosen, priority)
        # Each rank's best C+1 per expert contain the batch's best C+1, so gathering only those is enough.
        best = scores.topk(cap + 1, dim=0).values  # [C+1, E]
        if self.token_group is not None and dist.get_world_size(self.token_group) > 1:
            parts = [torch.empty_like(best) for _ in range(dist.get_world_size(self.token_group))]
            dist.all_gather(parts, best.contiguous(), group=self.token_group)
            best = torch.cat(parts).topk(cap + 1, dim=0).values
        threshold = best[-1]  # [E]; -inf when the expert has <= C assignments: keep them all
        return priority > threshold[chosen]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        router_in = x
        if self.training and self.router_jitter > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.router_jitter, 1.0 + self.router_jitter)
            router_in = x * noise
        logits = self.router(router_in).float()  # routing in fp32 even under autocast / bf16 weights
        probs = logits.softmax(-1)
        select = probs if self.expert_bias is None else probs + self.expert_bias
        chosen = select.topk(self.top_k, dim=-1).indices  # [N, k]
        priority = probs.gather(1, chosen)
        gates = priority / priority.sum(-1, keepdim=True) if self.normalize_gates else priority

        # Batch-wide statistics: token counts (and N) summed over the token group, before capacity. N stays on the
        # device: only capacity needs it on the host (one sync per layer; dropless routing has none here).
        counts = expert_counts(chosen.reshape(-1), self.n_experts).to(probs.dtype)
        totals = self._all_reduce(torch.cat([counts, counts.new_full((1,), n)]))
        counts_global, assignments = totals[:-1], (totals[-1:] * self.top_k).clamp(min=1)
        frac = counts_global / assignments
        means = self._sample_means(torch.cat([probs, logits.logsumexp(-1, keepdim=True).pow(2)], 1))
        self.aux_loss = self.n_experts * (frac * means[:-1]).sum()
        self.z_loss = means[-1]

        if self.capacity_factor is None:
            keep = torch.ones_like(chosen, dtype=torch.bool)
            kept = totals[-1:] * self.top_k  # every assignment: the batch-wide count needs no all-reduce of its own
        else:
            keep = self._keep_mask(priority.detach(), chosen, int(totals[-1].item()))
            kept = self._all_reduce(keep.sum().to(probs.dtype).reshape(1))
        self.stats = {
            "tokens_per_expert": counts_global.detach(),
            "dropped_fraction": (1.0 - kept / assignments).squeeze(0).detach(),
            "expert_index": chosen.detach(),  # [N, k] this rank's tokens' experts
            "kept": keep,  # [N, k] which of those assignments were within capacity
        }

        # Dispatch: the kept assignments grouped by expert (stable, so each expert sees tokens in batch order).
        # Dropless keeps every assignment: no nonzero (a device sync: its output size depends on the data).
        flat = keep.reshape(-1).nonzero().squeeze(1) if self.capacity_factor is not None else None
        expert_of = chosen.reshape(-1) if flat is None else chosen.reshape(-1)[flat]
        order = expert_of.argsort(stable=True)
        assign = order if flat is None else flat[order]
        token = assign // self.top_k
        out = self.experts(x[token], expert_counts(expert_of, self.n_experts))
        # Combine on the tokens' own rank: gates multiply here, so the router's gradient never crosses ranks.
        weighted = out * gates.reshape(-1)[assign].unsqueeze(1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))
        return y.reshape(shape)


def expert_counts(index: Tensor, n: int) -> Tensor:
    """``torch.bincount(index, minlength=n)`` for indices below ``n``, without bincount's device sync on CUDA (it
    reads the largest index to size its output).

    Args:
        index: integer expert indices, any shape (flattened).
        n: the number of experts.
    """
    index = index.reshape(-1).to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def moe_loss(model: nn.Module) -> Tensor:
    """Sum of `MoE.loss` over every MoE layer of ``model`` (after a forward); 0 when there is none.

    Args:
        model: any module containing `MoE` layers.
    """
    losses = [m.loss() for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else torch.zeros(())
