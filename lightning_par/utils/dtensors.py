"""The conversions between a parameter's DTensor and the plain tensor this rank holds of it.

Tensor parallelism leaves some parameters as DTensors and others plain (embeddings, head, norms), and most of the
engines work on what this rank holds: `local` takes it out, `like` puts a local tensor back in its parameter's
layout (as its gradient, or as optimizer state saved under the parameter's name); `local_data` is a parameter's
storage outside autograd, which ZeRO's masters view.
"""

from __future__ import annotations

from typing import Optional, overload

from torch import Tensor
from torch.distributed.tensor import DTensor


@overload
def local(t: Tensor) -> Tensor: ...
@overload
def local(t: None) -> None: ...
def local(t: Optional[Tensor]) -> Optional[Tensor]:
    """This rank's part of ``t`` (a DTensor's local tensor, no copy), or ``t`` itself when it is plain or None."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_data(p: Tensor) -> Tensor:
    """The storage this rank holds of parameter ``p``, outside autograd: a DTensor's local shard, or ``p.data``."""
    return p.detach().to_local() if isinstance(p, DTensor) else p.data  # type: ignore[attr-defined]


def like(value: Tensor, p: Tensor) -> Tensor:
    """``value``, this rank's part of a tensor laid out as ``p``: as a DTensor on ``p``'s mesh, placements, global
    shape and stride when ``p`` is one (no copy, no check: the caller knows the shapes agree), else as it is."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def storages(t: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``t``'s values on this rank, outside autograd: ``t``'s data itself, a DTensor's
    local shard, or the inner tensors of a wrapper subclass (torchao's ``NF4Tensor``: its 4-bit codes and scalers),
    which collectives cannot take whole."""
    t = local_data(t)
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if type(t) is Tensor or flatten is None:
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [part for name in names for part in storages(getattr(t, name))]
