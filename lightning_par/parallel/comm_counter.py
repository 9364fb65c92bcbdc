"""Count the bytes every collective puts on the wire, per rank, by phase and kind: what the planner's
communication model (`lightning_par.planner.comm`) is checked against, and what ``benchmarks/bench_comm_bytes.py``
prints.

Two ways in, because collectives take two roads:
- the ``torch.distributed`` Python entry points (``dist.all_reduce``, ``all_gather_into_tensor``, ...; FSDP2,
  DDP-style engines, object collectives) are wrapped where callers look them up at call time: the ``dist`` module
  attributes, the same names in ``distributed_c10d``, and the two names `lightning_par.parallel.zero.replicated`
  bound at import;
- DTensor's redistributions (tensor and sequence parallelism) call the functional collectives
  (``torch.ops._c10d_functional``) underneath the dispatcher, which no Python wrapper sees: a dispatch mode counts
  them. Their group is known only by name; the mode learns each name's size from the meshes of the DTensors it sees
  (a DTensor op always comes before the collectives it desugars into).
Lightning's own ``ddp`` is not counted: its all-reduces are issued from C++ (the DDP reducer).

Convention, "bytes on the wire per rank" for ring algorithms over n ranks: an all-reduce of B bytes moves
2B(n-1)/n, a reduce-scatter of a B-byte input B(n-1)/n, an all-gather producing B bytes B(n-1)/n, a broadcast of
B bytes B(n-1)/n (averaged over ranks), an all-to-all the bytes this rank sends to the others (its input less
the rows it keeps). Object collectives (pickled control data) are counted under the kind ``"object"``.
Rajbhandari et al., arXiv 1910.02054, section 7, count ZeRO's traffic this way.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par import _compat

SMALL = 1024  # bytes: collectives below this are scalars (loss logging, control), reported apart from the traffic

# Python entry point -> (kind, the argument holding the payload B, ring factor applied to B (n-1)/n).
_SPECS: dict[str, tuple[str, str, int]] = {
    "all_reduce": ("all_reduce", "tensor", 2),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 1),
    "all_gather_single": ("all_gather", "output_tensor", 1),
    "all_gather": ("all_gather", "tensor_list", 1),
    "broadcast": ("broadcast", "tensor", 1),
    "all_to_all_single": ("all_to_all", "input", 1),
    "barrier": ("barrier", "", 0),
}
# Collectives of pickled objects (control data: a pipeline's metadata and losses): what they issue inside is counted
# under the kind "object", apart from tensor traffic.
_OBJECTS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
# Functional collective (DTensor's) -> (kind, ring factor); the payload is the input, times n for an all-gather.
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_gather_into_tensor": ("all_gather", 1),
}


def _nbytes(t: Any) -> int:
    ts = t if isinstance(t, (list, tuple)) else [t]
    return sum(x.numel() * x.element_size() for x in ts)


class _FunctionalCounter(_compat.TorchDispatchMode):  # type: ignore[misc]
    """Counts ``_c10d_functional`` collectives into its `CommCounter`."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter
        self.sizes: dict[str, int] = {}  # group name -> ranks, learnt from the meshes of the DTensors seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            for a in _compat.tree_leaves((args, kwargs)):
                if isinstance(a, DTensor):
                    mesh = a.device_mesh
                    for dim in range(mesh.ndim):
                        group = mesh.get_group(dim)
                        self.sizes[group.group_name] = dist.get_world_size(group)
            return NotImplemented  # let DTensor desugar into plain ops (and collectives), which come back here
        name = _compat.op_name(func)
        space, _, op = name.partition("::")
        if space == _compat.C10D_FUNCTIONAL and op in _FUNCTIONAL and self.counter._depth == 0:
            kind, factor = _FUNCTIONAL[op]
            group_name = args[-1]
            n = self.sizes.get(group_name)
            if n is None:
                raise RuntimeError(
                    f"CommCounter saw {name} on group {group_name!r} before any DTensor on it; install the counter "
                    "before the step whose collectives it should count"
                )
            payload = _nbytes(args[0]) * (n if kind == "all_gather" else 1)
            self.counter.add(kind, factor * payload * (n - 1) / n)
        return func(*args, **kwargs)


class CommCounter:
    """Sums wire bytes and calls per ``(phase, kind, small)`` while installed; nested calls count once (outermost).

    Set ``phase`` to tag what follows (e.g. ``"setup"``, ``"step"``); ``small`` marks collectives under ``small``
    bytes of payload (scalars: logged losses, control flags).

    Args:
        small: payload bytes under which a collective counts as a scalar.
        functional: also count DTensor's functional collectives (a dispatch mode, active while installed).
    """

    def __init__(self, small: int = SMALL, functional: bool = True) -> None:
        self.phase = "setup"
        self.small = small
        self.bytes: dict[tuple[str, str, bool], float] = defaultdict(float)
        self.calls: dict[tuple[str, str, bool], int] = defaultdict(int)
        self._depth = 0
        self._object = 0  # inside an object collective: its inner tensor collectives count as "object"
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: Optional[_FunctionalCounter] = _FunctionalCounter(self) if functional else None

    def add(self, kind: str, wire_bytes: float, payload: Optional[int] = None) -> None:
        """Record one collective of ``kind`` moving ``wire_bytes`` per rank (``payload``: its size, for ``small``)."""
        kind = "object" if self._object else kind
        key = (self.phase, kind, (wire_bytes if payload is None else payload) < self.small)
        self.bytes[key] += wire_bytes
        self.calls[key] += 1

    def per_kind(self, phase: str) -> dict[str, float]:
        """Wire bytes per kind in ``phase``, scalars included (barriers, which move nothing, left out)."""
        out: dict[str, float] = defaultdict(float)
        for (ph, kind, _), b in self.bytes.items():
            if ph == phase and kind != "barrier":
                out[kind] += b
        return dict(out)

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        kind, arg, factor = _SPECS[name]
        sig = inspect.signature(orig)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                bound = sig.bind(*args, **kwargs)
                n = dist.get_world_size(bound.arguments.get("group"))
                payload = _nbytes(bound.arguments[arg]) if arg else 0
                if kind == "all_to_all":
                    self.add(kind, _sent(bound.arguments, payload, n), payload)
                else:
                    self.add(kind, factor * payload * (n - 1) / n, payload)
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_object(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._object += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._object -= 1

        return counted

    def install(self) -> None:
        """Start counting (idempotent per install/uninstall pair)."""
        import lightning_par.parallel.zero.replicated as zero_mod  # here: utils sits below parallel/ otherwise

        for module in (dist, c10d):
            for name in _SPECS:
                if hasattr(module, name):
                    self._patch(module, name, self._wrap(name, getattr(module, name)))
            for name in _OBJECTS:
                if hasattr(module, name):
                    self._patch(module, name, self._wrap_object(getattr(module, name)))
        # zero_replicated bound these at import time; patching `dist` alone would miss every ZeRO-1/2 bucket.
        for name in ("_reduce_scatter", "_all_gather"):
            orig = getattr(zero_mod, name)
            self._patch(zero_mod, name, self._wrap(orig.__name__, orig))
        if self._mode is not None:
            self._mode.__enter__()

    def _patch(self, module: Any, name: str, fn: Any) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, fn)

    def uninstall(self) -> None:
        """Stop counting and restore every wrapped entry point."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        for module, name, orig in reversed(self._saved):
            setattr(module, name, orig)
        self._saved.clear()


def _sent(arguments: dict[str, Any], payload: int, n: int) -> float:
    """Bytes an ``all_to_all_single`` sends to other ranks: its input less the rows it keeps."""
    x: Tensor = arguments["input"]
    splits = arguments.get("input_split_sizes")
    rank = dist.get_rank(arguments.get("group"))
    if not splits:
        return payload * (n - 1) / n
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return float(payload - splits[rank] * row)
