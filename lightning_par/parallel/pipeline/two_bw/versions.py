"""Weight versions of PipeDream-2BW (`lightning_par.parallel.pipeline.two_bw`): one stage's trainable weights as
one step's forwards saw them, kept for the backwards that run after the optimizer wrote the parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_par import _compat

__all__ = ["WeightVersion"]


def _alias(p: Tensor) -> Tensor:
    """A leaf on ``p``'s storage with its own version counter (the optimizer's in-place writes to ``p`` must not
    trip autograd's check on the graph that saved it: `WeightVersion.freeze` copies before they happen)."""
    with torch.no_grad():
        leaf = torch.empty(0, dtype=p.dtype, device=p.device)
        leaf.set_(p.untyped_storage(), p.storage_offset(), p.size(), p.stride())
    return leaf.requires_grad_(True)


class WeightVersion:
    """One stage's trainable weights as one step's forwards saw them.

    Args:
        holders: ``(module, name, parameter)`` for every place a trainable parameter of the stage is registered.
    """

    def __init__(self, holders: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
        self.holders = holders
        params = list(dict.fromkeys(p for _, _, p in holders))
        self.params = params
        self.leaves = [_alias(p) for p in params]
        self._slot = {id(p): i for i, p in enumerate(params)}
        self.frozen: Optional[list[Tensor]] = None
        # storage -> [(first element, element count, parameter index)]: where a saved tensor's values come from
        self._where: dict[int, list[tuple[int, int, int]]] = {}
        for i, p in enumerate(params):
            self._where.setdefault(p.untyped_storage().data_ptr(), []).append((int(p.storage_offset()), p.numel(), i))

    def _values(self) -> list[Tensor]:
        return self.frozen if self.frozen is not None else self.leaves

    def _pack(self, t: Tensor) -> Any:
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        for first, count, i in self._where.get(t.untyped_storage().data_ptr(), ()):
            if first <= t.storage_offset() < first + count:
                return (i, t.storage_offset() - first, tuple(t.size()), tuple(t.stride()))
        return t

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        i, offset, size, stride = packed
        base = self._values()[i]
        return base.as_strided(size, stride, base.storage_offset() + offset)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the stage on this version: its registered parameters swapped for this version's tensors (a forward
        builds its graph on them; a backward's recomputation reads them), saved views filed by parameter."""
        values = self._values()
        for m, name, p in self.holders:
            _compat.module_parameters(m)[name] = values[self._slot[id(p)]]  # type: ignore[assignment]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for m, name, p in self.holders:
                _compat.module_parameters(m)[name] = p

    def freeze(self) -> None:
        """Copy the version's values before the optimizer overwrites the parameters (the one extra weight copy).
        The copies take gradients too: a reentrant recomputation builds its graph on them."""
        if self.frozen is None:
            self.frozen = [leaf.detach().clone().requires_grad_(True) for leaf in self.leaves]

    def gradients(self) -> list[Optional[Tensor]]:
        """Per parameter, the gradient this version's backwards accumulated (None where none reached it)."""
        out: list[Optional[Tensor]] = []
        for i, leaf in enumerate(self.leaves):
            g = leaf.grad
            extra = self.frozen[i].grad if self.frozen is not None else None
            out.append(g if extra is None else extra if g is None else g + extra)
        return out
