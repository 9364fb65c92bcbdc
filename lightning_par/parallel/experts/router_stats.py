"""Router statistics over the global batch for MoE blocks we did not write (their own auxiliary loss unchanged).

A Hugging Face top-k router returns ``(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])``; its block
routes with the last two and discards the first, which the model records (``output_router_logits=True``) for its
load-balancing loss, ``E * sum_e f_e * P_e`` with ``f_e`` the share of assignments and ``P_e`` the mean
probability of expert ``e``. Computed from one rank's logits that loss is a product of two per-rank means, so the
data-parallel average differs from one process's value on the global batch.

So, under data parallelism, a forward hook replaces the recorded logits by those of every rank of the token group
(concatenated in rank order), and every rank computes the model's own loss on the global batch. The gather's
backward sums the gradient of every rank's loss (all-reduce) and keeps this rank's rows: with the strategy's
average over the ``dp`` ranks that is exactly the gradient of the one-process loss. The cost is one all-gather of
``N x E`` logits per layer and step (small beside the token all-to-alls). The blocks' routing itself never sees
the gathered logits. Only in training mode: evaluation and generation (possibly on one rank) keep per-rank
logits, except that a sample's context-parallel chunks are gathered there too (its cp ranks run every forward
together), so a validation loss under cp is the one a rank would compute on its whole samples. A model that masks
padding in that loss (``attention_mask`` passed to the model) would pair a local mask with global logits and is not
supported with ``output_router_logits`` under data parallelism.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class _GatherRows(torch.autograd.Function):
    """All-gather of rows (uneven counts allowed); backward: all-reduce the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        n = dist.get_world_size(group)
        sizes = [torch.empty(1, dtype=torch.int64, device=x.device) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device), group=group)
        counts = [int(s) for s in sizes]
        pad = x.new_zeros((max(counts) - x.shape[0], *x.shape[1:]))
        parts = [x.new_empty((max(counts), *x.shape[1:])) for _ in range(n)]
        dist.all_gather(parts, torch.cat([x.detach(), pad]).contiguous(), group=group)
        rank = dist.get_rank(group)
        ctx.group, ctx.start, ctx.rows, ctx.total = group, sum(counts[:rank]), x.shape[0], sum(counts)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start : ctx.start + ctx.rows], None


def is_top_k_output(out: Any) -> bool:
    """Whether a router's output is ``(logits [N, E], weights [N, k], index [N, k])``, transformers' top-k layout."""
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, Tensor) for t in out)):
        return False
    logits, weights, index = out
    return (
        logits.dim() == 2 and weights.dim() == 2 and weights.shape == index.shape
        and logits.shape[0] == index.shape[0] and not index.is_floating_point()
    )  # fmt: skip


def records_lone_logits(model: nn.Module, router: nn.Module) -> bool:
    """Whether ``router`` returns its logits alone (no top-k triple) while ``model`` records router logits for a
    load-balancing loss (a Hugging Face config with ``output_router_logits=True``): found before training by calling
    the router once, without gradients, on one token of its width. ``False`` where that call fails."""
    if not any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in model.modules()):
        return False
    weights = [p for p in router.parameters() if p.dim() == 2]
    if not weights:
        return False
    width = weights[0].shape[-1]
    try:
        with torch.no_grad():
            out = router(weights[0].new_zeros(1, 1, width))
    except Exception:
        return False
    return isinstance(out, Tensor)


def lone_logits_error(router: nn.Module) -> ValueError:
    """The refusal of data parallelism for a router whose lone logits the model records (`records_lone_logits`)."""
    return ValueError(
        f"{type(router).__name__} returns its logits alone and the model records them for its load-balancing loss "
        "(output_router_logits=True): under data parallelism that loss would see this rank's tokens only and train "
        "differently from one process. Train it under 'tp' (every tp rank holds the same tokens; the MoE layer is "
        "kept whole), or set output_router_logits=False"
    )


def gather_router_logits(
    router: nn.Module, group: dist.ProcessGroup, eval_group: Optional[dist.ProcessGroup] = None
) -> RemovableHandle:
    """Make ``router``'s first output (the logits the model records) span every rank of ``group``.

    In training mode over ``group``; in evaluation over ``eval_group`` only (the context-parallel ranks, which hold
    chunks of the same samples and always run a forward together), or not at all: data-parallel evaluation and
    generation may run on some ranks only, and each keeps its own batch's logits. Only a router returning
    ``(logits [N, E], weights [N, k], index [N, k])`` is changed; any other output passes unchanged (its block may
    route with the logits themselves).

    Args:
        router: the router module of a recognised stacked-experts block.
        group: the ranks whose tokens form one batch (dp, times cp).
        eval_group: the ranks whose tokens form one sample in evaluation (cp), or ``None``.
    """

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        over = group if module.training else eval_group
        if over is None:
            return out
        if not is_top_k_output(out):
            if isinstance(out, Tensor) and len(module._forward_hooks) > 1:
                # Logits alone (Hugging Face DBRX): the block routes with the very tensor the model's recorder (the
                # other hook) keeps for its load-balancing loss, so it cannot be gathered for one and not the other.
                # Found at set-up where the model says so (`records_lone_logits`); here for any other recorder.
                raise lone_logits_error(module)
            return out
        return (_GatherRows.apply(out[0], over), out[1], out[2])

    # prepend: the model's output recorders (installed on its first forward) must see the gathered logits.
    return router.register_forward_hook(hook, prepend=True)
