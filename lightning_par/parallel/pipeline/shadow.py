"""What stands in for a module another pipeline stage owns: a meta-device copy of its subtree (`shadow`).

The user's code still reads a stand-in's attributes, configs, dtypes and shapes (Hugging Face ``ViTModel.forward``
reads ``self.embeddings.patch_embeddings.projection.weight.dtype``), but its tensors have no storage and are not
registered, so optimizers, checkpoints and ZeRO never see them. A stand-in for a unit of the first stage (an
embedding) runs on every later stage for every microbatch: its output is only a shape (the stage's first block
swaps in the received activation), so the shapes a meta-device forward gives are remembered per input signature
and later calls make the zeros directly (a meta forward and two tree maps cost ~0.1-0.2 ms of host time per call,
twice per forward of a GPT stage; `benchmarks/bench_pipeline_throughput.py`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Hashable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_par import _compat
from lightning_par.parallel.pipeline.owners import PipelineError

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


def shadow(
    original: nn.Module, name: str, *, before: bool, device: torch.device, why: str, in_trunk: Callable[[], bool]
) -> nn.Module:
    """A stand-in for the unit ``original`` on a stage that does not own it: a meta-device copy of its subtree.

    Its parameters and buffers stay readable as attributes (meta tensors, no storage) but are unregistered, so the
    rank's model holds none of them. Called, a unit of the first stage (``before``) returns zeros of the output's
    shape and dtype on ``device`` (the stage's first block replaces the hidden state with the received activation,
    so only the shapes of what the user's code computes from it matter): the first call with an input signature
    (shapes, dtypes, plain values, train / eval, autocast) runs the copy on the meta device, later ones reuse its
    shapes. A unit of the last stage raises: it cannot run where its weights are not.

    Args:
        original: the unit.
        name: its qualified name (for errors).
        before: it belongs to the first stage (else to the last).
        device: this rank's device.
        why: how its stage was chosen (for errors): `pipeline.owners.Ownership.why`.
        in_trunk: whether the trunk has started in the current run of the user's code.
    """
    copied = meta_copy(original)
    forward = copied.forward
    # Input signature -> (output spec, or None for a lone tensor; its leaves as `_Zeros` or values).
    shapes: dict[Hashable, tuple[Any, list[Any]]] = {}

    def run(*args: Any, **kwargs: Any) -> Any:
        if not before or in_trunk():
            now = "after" if in_trunk() else "before"
            raise PipelineError(
                f"{name} belongs to the {'first' if before else 'last'} pipeline stage ({why}) but ran {now} the "
                "trunk here, on a stage that does not hold its weights; give the "
                "LightningModule an example_input_array of a real input, so that the probe sees the real call order"
            )
        key = _signature(copied, args, kwargs)
        known = shapes.get(key) if key is not None else None
        if known is None:
            meta_args, meta_kwargs = _compat.tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs))
            out = forward(*meta_args, **meta_kwargs)
            leaves, spec = ([out], None) if isinstance(out, Tensor) else _compat.tree_flatten(out)
            known = spec, [_Zeros(t) if isinstance(t, Tensor) else t for t in leaves]
            if key is not None and all(isinstance(t, _PLAIN) for t in leaves):
                shapes[key] = known
        spec, made = known
        made = [torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, _Zeros) else t for t in made]
        return made[0] if spec is None else _compat.tree_unflatten(made, spec)

    object.__setattr__(copied, "forward", run)
    object.__setattr__(copied, "_lp_shadow_of", name)
    return copied
