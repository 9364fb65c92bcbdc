"""What stands in for a trunk block in a pipeline stage's run of the user's code (`pipeline.stages`).

A `_PassThrough` replaces a block another rank owns, for good; a `_Walker` replaces an owned block for the length
of a walk (`PipelineModel.walk`), so that no hook of the block (FSDP2's, under ZeRO-3) sees a call that computes
nothing. Both answer the user's code's attribute reads from the block (a meta-device copy of it, for a pass-through)
and route calls to the cut model's dispatch (`BlockCalls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

from torch import nn

from lightning_par.parallel.pipeline.meta import meta_copy


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
