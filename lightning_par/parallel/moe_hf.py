"""Expert parallelism for Hugging Face Mixtral-family MoE blocks, which the user did not write.

``MixtralSparseMoeBlock`` routes with its ``gate`` and calls ``experts(hidden [N, d], top_k_index [N, k],
top_k_weights [N, k])``; ``MixtralExperts`` holds stacked ``gate_up_proj [E, 2f, d]`` and ``down_proj [E, d, f]``
and applies the gate weights itself. Under expert parallelism the experts module keeps its rows
``[r*E/ep, (r+1)*E/ep)`` of both (same names) and its forward is replaced, on that instance only, by: group the
assignments by expert, exchange them with the ep group (`ExpertDispatch`), run the local experts with Mixtral's
math (``down(act(gate) * up)``), exchange back, weight and sum per token on the token's own rank.

Mixtral is dropless, so the result equals the original forward whatever the split of tokens over ranks. Its
load-balancing loss (``output_router_logits=True``) is computed by the model from this rank's router logits, as
under plain data parallelism (its nonlinearity in the batch makes the per-rank mean differ slightly from one
process's value).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_par.parallel.expert_dispatch import ExpertDispatch


def _local_experts(module: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
    # In the tokens' dtype, as `lightning_par.nn.Experts` (FSDP2 leaves the ignored expert shards in fp32).
    gate_up, down = cast(Tensor, module.gate_up_proj).to(x.dtype), cast(Tensor, module.down_proj).to(x.dtype)
    act = cast(Callable[[Tensor], Tensor], module.act_fn)
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        gate, up = nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(nn.functional.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_empty(0, down.shape[1])


def shard_mixtral_experts(experts: nn.Module, dispatch: ExpertDispatch, n_experts: int) -> None:
    """Replace ``experts.forward`` (a ``MixtralExperts`` whose weights already hold this rank's rows).

    Args:
        experts: the experts module of a ``MixtralSparseMoeBlock``.
        dispatch: the all-to-all exchange over this layer's ep group.
        n_experts: experts of the whole layer (the router's width).
    """

    def forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Any:
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=n_experts)
        rows, local_counts = dispatch.dispatch(self, (hidden[token], counts))
        out = dispatch.combine(self, None, _local_experts(self, rows, local_counts))
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))

    experts.forward = types.MethodType(forward, experts)
