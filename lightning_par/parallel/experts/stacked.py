"""Expert parallelism for stacked-experts MoE blocks we did not write (Hugging Face transformers 5 families).

Such a block routes with its own router and calls ``experts(hidden [N, d], top_k_index [N, k],
top_k_weights [N, k])``; the experts module holds stacked ``[E, ...]`` weights and applies the gate weights
itself. Under expert parallelism the experts module keeps its rows ``[r*E/ep, (r+1)*E/ep)`` of every weight (same
names) and its forward is replaced, on that instance only, by: group the assignments by expert, exchange them
with the ep group (`ExpertDispatch`), run the **model's own expert forward** on the received rows (each row sent
to one local expert, gate weight 1, so Mixtral's SwiGLU, GPT-OSS's clamped interleaved gate_up and biases, or any
other expert math runs unchanged, through whatever experts implementation the model's config selects), exchange
back, weight and sum per token on the token's own rank (the gates' gradient never crosses ranks).

These families are dropless, so the result equals the original forward whatever the split of tokens over ranks.

Some experts take only a *dense routed* input (Llama-4: ``experts(x [E*T, d])``, every token repeated to every
expert and scaled by its router score, zero where not chosen, the module's forward viewing it as ``[E, T, d]``).
That is the same exchange with ``T`` rows for each expert: each rank sends every other the rows of its experts,
runs the model's own forward on the ``[E/ep, sum of T, d]`` it received, and gets its rows back in order, so the
layer's sum over experts happens on the token's own rank as before.

Low-rank adapters on the stacked weights (peft's ``ParamWrapper``: LoRA with ``target_parameters``, ``r`` rows of
``lora_A`` and ``r`` strided columns of ``lora_B`` per expert, folded into the weight while the wrapper runs) stay
whole on every rank: each rank folds in its experts' share only (`local_expert_adapters`). The adapters are small,
and whole they keep the names and shapes one process gives them (checkpoints resume on any layout); their
gradients hold each rank's experts' columns, and the average over the data-parallel ranks that dense parameters get
is exact: every rank's tokens reach each expert's owner in its ep group once.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_par.nn.moe import expert_counts
from lightning_par.parallel.experts.dispatch import ExpertDispatch, expert_index
from lightning_par.parallel.experts.structure import adapted_base


def _check_call(name: str, hidden: Any, index: Any, weights: Any) -> None:
    ok = (
        isinstance(hidden, Tensor) and hidden.dim() == 2 and isinstance(index, Tensor) and index.dim() == 2
        and not index.is_floating_point() and isinstance(weights, Tensor) and weights.shape == index.shape
        and index.shape[0] == hidden.shape[0]
    )  # fmt: skip
    if not ok:
        got = ", ".join(
            str(tuple(a.shape)) if isinstance(a, Tensor) else type(a).__name__ for a in (hidden, index, weights)
        )
        raise TypeError(
            f"{name}: stacked experts are expected to be called as experts(hidden [N, d], top_k_index [N, k] "
            f"(integer), top_k_weights [N, k]); got ({got}). Train this model with a data-parallel strategy "
            "(e.g. 'zero3'), or make its experts a lightning_par.nn.MoE"
        )


def shard_stacked_experts(experts: nn.Module, dispatch: ExpertDispatch, n_experts: int, name: str) -> None:
    """Replace ``experts.forward`` (a stacked-experts module whose weights already hold this rank's rows).

    Args:
        experts: the experts module of the block.
        dispatch: the all-to-all exchange over this layer's ep group.
        n_experts: experts of the whole layer (the router's width).
        name: its qualified name, for errors.
    """
    if isinstance(getattr(experts, "num_experts", None), int):
        # The model's experts implementations (eager loop, grouped_mm, batched_mm) size their bins by it.
        experts.num_experts = dispatch.n_local  # type: ignore[assignment]
    own_forward: Callable[..., Tensor] = experts.forward  # the class's (or the model's chosen implementation's)
    state = {"local": False}

    def run_local(module: nn.Module, rows: Tensor, counts: list[int], dense: bool = False) -> Tensor:
        # Each received row goes to one local expert with weight 1: the model's forward returns expert(row). The
        # dense layout needs no routing: its rows come expert-major, the same number for each local expert.
        args: tuple[Tensor, ...] = (rows,)
        if not dense:
            index = expert_index(counts, rows.device).unsqueeze(1)
            args = (rows, index, torch.ones(index.shape, dtype=rows.dtype, device=rows.device))
        params = dict(module.named_parameters())  # DBRX keeps its flat expert weights one module down
        state["local"] = True
        try:
            if rows.shape[0] == 0:
                # No rows for this rank's experts: nothing to compute (DBRX's own forward cannot reshape zero rows).
                # Still from `rows`, so that the backward all-to-all of the dispatch runs where it does on the other
                # ranks: collectives in the same order everywhere.
                out = rows * 0
            elif any(p.dtype != rows.dtype for p in params.values()):
                # In the tokens' dtype, as lightning_par.nn.Experts: FSDP2 leaves the ignored expert shards fp32.
                cast = {k: p.to(rows.dtype) for k, p in params.items()}
                out = functional_call(module, cast, args)
            else:
                out = own_forward(*args)
        finally:
            state["local"] = False
        # Every local expert joins the graph (a rank may receive no rows for one): its gradient is then a tensor on
        # every rank, and the expert-data-parallel reduction sums the same list everywhere. DBRX's forward returns
        # [N, 1, d] for N rows: one row per token, as sent.
        return out.reshape(rows.shape[0], out.shape[-1]) + sum(p.reshape(-1)[0] * 0 for p in params.values())

    def forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Any:
        if state["local"]:
            return own_forward(hidden, top_k_index, top_k_weights)
        shape = hidden.shape if isinstance(hidden, Tensor) else None
        if shape is not None and hidden.dim() > 2:  # DBRX passes [B, T, d] with routing for its B * T tokens
            hidden = hidden.reshape(-1, shape[-1])
        _check_call(name, hidden, top_k_index, top_k_weights)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = expert_counts(flat, n_experts)
        rows, local_counts = dispatch.dispatch(self, (hidden[token], counts))
        out = dispatch.combine(self, None, run_local(self, rows, local_counts))
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype)).reshape(shape)

    def dense_forward(self: nn.Module, hidden: Tensor) -> Any:
        if state["local"]:
            return own_forward(hidden)
        if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[0] % n_experts:
            got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise TypeError(
                f"{name}: experts called with one input are expected to take the dense routed layout, x [E*T, d] "
                f"with E={n_experts}; got {got}. Train this model with a data-parallel strategy (e.g. 'zero3')"
            )
        counts = torch.full((n_experts,), hidden.shape[0] // n_experts, dtype=torch.int64, device=hidden.device)
        rows, local_counts = dispatch.dispatch(self, (hidden, counts))
        return dispatch.combine(self, None, run_local(self, rows, local_counts, dense=True))

    experts.forward = types.MethodType(dense_forward if _dense(own_forward) else forward, experts)


def _dense(forward: Callable[..., Tensor]) -> bool:
    """Whether an experts forward takes the dense routed input alone: one positional parameter, none optional (GPT-OSS
    declares its routing arguments with defaults) and no ``*args``."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    return sum(1 for p in params if p.kind in positional) == 1


def local_expert_adapters(block: nn.Module, experts: nn.Module, first: int, n_local: int) -> None:
    """Make every parameter adapter around ``experts`` (inside ``block``) fold in experts ``[first, first + n_local)``
    only, the rows ``experts`` keeps (module docstring): peft's ``get_delta_factors`` / ``get_delta_weight`` of each
    wrapper, on that instance, return the local experts' slice of what they return for all."""
    local = slice(first, first + n_local)
    for wrapper in block.modules():
        if adapted_base(wrapper) is None or not any(m is experts for m in wrapper.modules()):
            continue
        for method in ("get_delta_factors", "get_delta_weight"):
            if callable(whole := getattr(wrapper, method, None)):
                object.__setattr__(wrapper, method, _local_slice(whole, local, method == "get_delta_factors"))


def _local_slice(whole: Callable[..., Any], local: slice, factors: bool) -> Callable[..., Any]:
    def sliced(*args: Any, **kwargs: Any) -> Any:
        out = whole(*args, **kwargs)
        if factors:  # (lhs [E, ...], rhs [E, ...], scaling)
            return out[0][local], out[1][local], out[2]
        return out[local]  # the delta [E, ...]

    return sliced
