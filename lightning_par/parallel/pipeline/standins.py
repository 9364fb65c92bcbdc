"""What stands in for a module a pipeline stage does not hold, in its run of the user's code (`pipeline.stages`).

Outside the trunk, `shadow`: a meta-device copy of a unit another stage owns. The user's code still reads a
stand-in's attributes, configs, dtypes and shapes (Hugging Face ``ViTModel.forward`` reads
``self.embeddings.patch_embeddings.projection.weight.dtype``), but its tensors have no storage and are not
registered, so optimizers, checkpoints and ZeRO never see them. A stand-in for a unit of the first stage (an
embedding) runs on every later stage for every microbatch: its output is only a shape (the stage's first block
swaps in the received activation), so the shapes a meta-device forward gives are remembered per input signature
and later calls make the zeros directly (`pipeline.meta.MetaOutputs`; twice per forward of a GPT stage,
`benchmarks/bench_pipeline_throughput.py`).

In the trunk, a `_PassThrough` replaces a block another rank owns, for good; a `_Walker` replaces an owned block for
the length of a walk (`PipelineModel.walk`), so that no hook of the block (FSDP2's, under ZeRO-3) sees a call that
computes nothing. Both answer the user's code's attribute reads from the block (a meta-device copy of it, for a
pass-through) and route calls to the cut model's dispatch (`BlockCalls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from torch import nn

from lightning_par import _compat
from lightning_par.parallel.pipeline.meta import MetaOutputs, meta_copy
from lightning_par.parallel.pipeline.slots import PipelineError

__all__ = ["BlockCalls", "replace_module", "shadow"]


class BlockCalls(Protocol):
    """The cut model's dispatch of a trunk block's call (`PipelineModel._block_call`)."""

    def _block_call(self, i: int, forward: Optional[Callable[..., Any]], args: tuple, kwargs: dict) -> Any: ...


class _StandIn(nn.Module):
    """Routes calls to the cut model's dispatch and reads the attributes it lacks from ``_original``."""

    _owner: BlockCalls
    _original: nn.Module

    def __init__(self, owner: BlockCalls, index: int, original: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_original", original)
        self.index = index

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None or name.startswith("__"):
                raise
            return getattr(original, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._block_call(self.index, None, args, kwargs)


class _PassThrough(_StandIn):
    """Stands in for a trunk block that another rank owns. Code around the trunk may read the block's attributes
    (torch's ``nn.TransformerEncoder.forward`` reads ``self.layers[0].self_attn.batch_first`` for its fast path):
    what the stand-in lacks is read from a meta-device copy of the block (`meta.meta_copy`: no storage, not
    registered, so no optimizer, checkpoint or ZeRO sees it)."""

    def __init__(self, owner: BlockCalls, index: int, name: str, block: nn.Module) -> None:
        super().__init__(owner, index, meta_copy(block))
        self.block_name = name


class _Walker(_StandIn):
    """Stands in for an owned block during a walk (`PipelineModel.walk`): the block's attributes, none of its hooks."""


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
    outputs = MetaOutputs(copied, device)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not before or in_trunk():
            now = "after" if in_trunk() else "before"
            raise PipelineError(
                f"{name} belongs to the {'first' if before else 'last'} pipeline stage ({why}) but ran {now} the "
                "trunk here, on a stage that does not hold its weights; give the "
                "LightningModule an example_input_array of a real input, so that the probe sees the real call order"
            )
        return outputs(args, kwargs)

    object.__setattr__(copied, "forward", run)
    object.__setattr__(copied, "_lp_shadow_of", name)
    return copied


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at ``root``'s submodule path ``name`` (a stand-in in a block's or a unit's place, or back)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    _compat.set_child_module(parent, leaf, new)
