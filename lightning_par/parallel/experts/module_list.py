"""Expert parallelism for MoE blocks whose experts are an ``nn.ModuleList`` of MLPs (user code, other libraries).

Such a block calls ``self.experts[e](rows)`` itself, expert by expert, in its own loop (and may skip experts that
got no tokens, differently on each rank), so one call cannot be exchanged on its own without the ranks falling
out of step. The block's forward therefore runs twice, on that instance only:

1. *record*: every expert call returns zeros and keeps its input rows (with their autograd history); the output is
   discarded. The RNG state is restored afterwards, so both passes draw the same router noise.
2. the recorded rows, grouped by expert, make one exchange with the ep group (`ExpertDispatch`): each rank runs
   its ``E/ep`` experts (the user's own modules) on the rows of every rank, and the outputs come back;
3. *replay*: the block runs again and each expert call returns the output computed for its rows, so the model's
   own routing, gate weighting and combination run unchanged (and its gate gradient never crosses ranks).

Cost: the block's routing runs twice (the router is a small matmul); the experts run once. Each rank keeps the
modules of its own experts under their original names (``experts.3.up.weight``) and a parameter-free
`RemoteExpert` in the other slots. Side effects of the block's forward (a stored aux loss) happen twice; the
second, kept one is the real one.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_par.parallel.experts.dispatch import ExpertDispatch


class RemoteExpert(nn.Module):
    """The slot of an expert held by another ep rank; its calls are served by the exchange."""

    def __init__(self, index: int, owner: int, served: _ModuleListExperts) -> None:
        super().__init__()
        self.index, self.owner = index, owner
        self._served = [served]  # a list: not a submodule

    def forward(self, x: Tensor, *rest: Any, **kwargs: Any) -> Tensor:
        return self._served[0].call(self.index, x, rest, kwargs)

    def extra_repr(self) -> str:
        return f"expert {self.index}, held by ep rank {self.owner}"


class _ModuleListExperts:
    def __init__(self, name: str, experts: nn.ModuleList, dispatch: ExpertDispatch, rank: int, n_local: int) -> None:
        self.name, self.dispatch, self.n_local = name, dispatch, n_local
        self.first = rank * n_local
        self.n_experts = len(experts)
        self.local = [experts[self.first + i] for i in range(n_local)]
        self.mode = "off"
        self.inputs: list[list[Tensor]] = []
        self.outputs: list[list[Tensor]] = []

    def call(self, e: int, x: Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        if rest or kwargs or not isinstance(x, Tensor) or x.dim() != 2:
            raise TypeError(
                f"{self.name}.{e}: under expert parallelism an expert must be called with one [rows, d] tensor; got "
                f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))} and {len(rest) + len(kwargs)} more argument(s). "
                "Train this model with a data-parallel strategy (e.g. 'zero3')"
            )
        if self.mode == "record":
            self.inputs[e].append(x)
            return torch.zeros_like(x)  # an expert maps [n, d] -> [n, d]: its output joins the hidden stream
        if self.mode == "replay" and self.outputs[e] and self.outputs[e][0].shape[0] == x.shape[0]:
            return self.outputs[e].pop(0)
        raise RuntimeError(
            f"{self.name}.{e}: the block called its experts differently in its two passes (mode {self.mode}); "
            "expert parallelism needs a block whose routing is a deterministic function of its input and RNG; "
            "train it with a data-parallel strategy (e.g. 'zero3')"
        )

    def exchange(self, like: Tensor) -> None:
        # Known on the host: an asynchronous copy (torch.tensor(..., device=cuda) would wait for the device).
        counts = torch.tensor([sum(t.shape[0] for t in xs) for xs in self.inputs]).to(like.device, non_blocking=True)
        flat = [t for xs in self.inputs for t in xs]
        x = torch.cat(flat) if flat else like.new_zeros((0, like.shape[-1]))
        rows, local_counts = self.dispatch.dispatch(None, (x, counts))  # type: ignore[arg-type]
        outs = [self._run(i, r) for i, r in enumerate(rows.split(local_counts))]
        back = self.dispatch.combine(None, None, torch.cat(outs))  # type: ignore[arg-type]
        pieces = iter(back.split([t.shape[0] for t in flat]))
        self.outputs = [[next(pieces) for _ in xs] for xs in self.inputs]

    def _run(self, i: int, rows: Tensor) -> Tensor:
        expert = self.local[i]
        params = dict(expert.named_parameters())
        forward = cast(Callable[[Tensor], Tensor], expert.__dict__["_lp_own_forward"])
        if any(p.dtype != rows.dtype for p in params.values()):
            # In the tokens' dtype (FSDP2 mixed precision leaves the ignored expert modules in fp32).
            self.mode, mode = "local", self.mode
            try:
                out = functional_call(expert, {k: p.to(rows.dtype) for k, p in params.items()}, (rows,))
            finally:
                self.mode = mode
        else:
            out = forward(rows)
        # Every local expert joins the graph even with no rows, so its gradient exists on every rank.
        return out + sum(p.reshape(-1)[0] * 0 for p in params.values())


def shard_module_list_experts(
    block: nn.Module, experts: nn.ModuleList, dispatch: ExpertDispatch, rank: int, n_local: int, name: str
) -> list[nn.Module]:
    """Keep this rank's experts of ``experts`` (others become `RemoteExpert`) and make ``block`` run in two passes.

    Args:
        block: the MoE block (its forward is replaced on this instance).
        experts: its ``nn.ModuleList`` of ``E`` experts.
        dispatch: the all-to-all exchange over the layer's ep group.
        rank: this rank's index in the ep group.
        n_local: ``E / ep``.
        name: the qualified name of ``experts``, for errors.

    Returns:
        the expert modules this rank keeps, in order.
    """
    served = _ModuleListExperts(name, experts, dispatch, rank, n_local)
    for e in range(len(experts)):
        if served.first <= e < served.first + n_local:
            module = experts[e]
            module._lp_own_forward = module.forward  # type: ignore[assignment]

            def forward(self: nn.Module, x: Tensor, *rest: Any, _e: int = e, **kwargs: Any) -> Tensor:
                if served.mode == "local":
                    return self._lp_own_forward(x, *rest, **kwargs)  # type: ignore[operator, no-any-return]
                return served.call(_e, x, rest, kwargs)

            module.forward = types.MethodType(forward, module)
        else:
            experts[e] = RemoteExpert(e, e // n_local, served)
    own_forward = block.forward

    def block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        like = next(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
        devices = [like.device.index or 0] if like.device.type == "cuda" else []
        served.inputs = [[] for _ in range(served.n_experts)]
        with torch.random.fork_rng(devices=devices):
            served.mode = "record"
            try:
                own_forward(*args, **kwargs)
            finally:
                served.mode = "off"
        served.exchange(like)
        served.inputs, served.mode = [], "replay"
        try:
            return own_forward(*args, **kwargs)
        finally:
            served.mode, served.outputs = "off", []

    block.forward = types.MethodType(block_forward, block)
    return served.local
