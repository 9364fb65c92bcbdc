"""Meta-device copies of modules, and their outputs remembered as shapes (`meta_copy`, `MetaOutputs`).

What stands in for a module a pipeline stage does not hold (`pipeline.standins`) is a
copy of it on the meta device: readable attributes, no storage. Called, it gives the structure, shapes and plain
values of the module's output (a meta forward), which the stand-in hands out as zeros on the rank's device. A meta
forward and two tree maps cost ~0.1-0.2 ms of host time, so the shapes are remembered per input signature.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Hashable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_par import _compat
from lightning_par.blocks.trunk import Trunk

# Non-tensor leaves a remembered output may hand out again, and input leaves a signature may hold by value: values
# that cannot change in place.
_IMMUTABLE = (type(None), bool, int, float, str, torch.dtype, torch.device)
_PLAIN = (Tensor, *_IMMUTABLE)


class _Zeros:
    """A remembered tensor leaf: made again as zeros of this shape and dtype."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype = t.shape, t.dtype


def meta_copy(original: nn.Module) -> nn.Module:
    """A copy of ``original``'s subtree (forward hooks included) whose tensors are on the meta device and held as
    plain attributes: readable, but out of ``parameters()``, ``state_dict()`` and ``.to()``."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(original.parameters(), original.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    copied = copy.deepcopy(original, memo)
    for m in copied.modules():
        # Out of the registries (parameters(), state_dict(), .to()), still attributes: plain instance attributes.
        tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        for tname, t in tensors:
            delattr(m, tname)
            object.__setattr__(m, tname, t)
    return copied


def _leaf_key(x: Any) -> Hashable:
    return (x.shape, x.dtype) if isinstance(x, Tensor) else (type(x), x)


def _signature(module: nn.Module, args: tuple, kwargs: dict) -> Optional[Hashable]:
    """What a meta forward's output shapes can depend on; ``None`` when an input is not plain data (not cached)."""
    if all(isinstance(x, _PLAIN) for x in itertools.chain(args, kwargs.values())):
        # The usual call (an embedding on token ids) holds no containers: no pytree walk (~20 us).
        inputs: Hashable = (tuple(map(_leaf_key, args)), tuple((k, _leaf_key(v)) for k, v in kwargs.items()))
    else:
        leaves, spec = _compat.tree_flatten((args, kwargs))
        if not all(isinstance(x, _PLAIN) for x in leaves):
            return None
        inputs = (spec, tuple(map(_leaf_key, leaves)))
    return inputs, module.training, torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled()


class MetaOutputs:
    """``module``'s output for given inputs, made as zeros on ``device`` from a meta forward of ``copied`` (its
    `meta_copy`): the first call with an input signature (shapes, dtypes, plain values, train / eval, autocast) runs
    the copy on the meta device, later ones reuse its shapes.

    Args:
        copied: a `meta_copy` of the module.
        device: where the zeros are made.
    """

    def __init__(self, copied: nn.Module, device: torch.device) -> None:
        self.copied, self.forward, self.device = copied, copied.forward, device
        # Input signature -> (output spec, or None for a lone tensor; its leaves as `_Zeros` or values).
        self.shapes: dict[Hashable, tuple[Any, list[Any]]] = {}

    def __call__(self, args: tuple, kwargs: dict, keep: Optional[Tensor] = None) -> Any:
        """The output for ``args`` / ``kwargs``; ``keep``, when given, stands for the first tensor leaf of its shape
        and dtype (a block's hidden state handed on as it is: no zeros made for it)."""
        key = _signature(self.copied, args, kwargs)
        known = self.shapes.get(key) if key is not None else None
        if known is None:
            meta_args, meta_kwargs = _compat.tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
            out = self.forward(*meta_args, **meta_kwargs)
            leaves, spec = ([out], None) if isinstance(out, Tensor) else _compat.tree_flatten(out)
            known = spec, [_Zeros(t) if isinstance(t, Tensor) else t for t in leaves]
            if key is not None and all(isinstance(t, _PLAIN) for t in leaves):
                self.shapes[key] = known
        spec, made = known
        kept = keep is None
        out_leaves = []
        for t in made:
            if isinstance(t, _Zeros):
                if not kept and keep is not None and (t.shape, t.dtype) == (keep.shape, keep.dtype):
                    out_leaves.append(keep)
                    kept = True
                    continue
                t = torch.zeros(t.shape, dtype=t.dtype, device=self.device)
            out_leaves.append(t)
        return out_leaves[0] if spec is None else _compat.tree_unflatten(out_leaves, spec)


def check_stand_ins(
    trunk: Trunk, calls: dict[int, tuple[tuple, dict, Any]], conflicts: dict[int, str]
) -> tuple[int, ...]:
    """The blocks a stand-in cannot answer with its first argument, each checked to run on the meta device.

    On a stage that starts after block ``i``, block ``i`` is a stand-in whose output the user's code still unpacks
    and reads (Swin's encoder takes the next stage's input dimensions from it). A block that returns a tensor of its
    input's shape and dtype is answered with that input; any other is answered with its meta-device forward, made
    as zeros (`pipeline.meta.MetaOutputs`). Where that forward fails (data-dependent shapes), no stage may start
    after the block: the cuts behind it become conflicts, refused before the first step.
    """
    reshaped = []
    for i, (args, kwargs, out) in sorted(calls.items()):
        if i == len(trunk.names) - 1:
            continue  # no stage starts after the last block
        hidden = args[0] if args else None
        if isinstance(out, Tensor) and isinstance(hidden, Tensor) and (out.shape, out.dtype) == (
            hidden.shape, hidden.dtype
        ):  # fmt: skip
            continue
        reshaped.append(i)
        try:
            with torch.no_grad():
                MetaOutputs(meta_copy(trunk.blocks[i]), torch.device("meta"))(args, kwargs)
        except Exception as err:  # a stand-in for this block would fail in the step: refuse the cuts behind it now
            why = (
                f"{trunk.names[i]} returns {type(out).__name__}, not a tensor of its input's shape, and a stage "
                f"starting after it must stand in for it with its meta-device forward, which fails "
                f"({type(err).__name__}: {err})"
            )
            for cut in range(i + 1, len(trunk.names)):
                conflicts.setdefault(cut, why)
    return tuple(reshaped)
