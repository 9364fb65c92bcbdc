"""Activation checkpointing of whole blocks: recompute a block's forward in backward instead of storing it.

Costs one extra forward of each checkpointed block (~33% more compute when all are) and saves the block's
internal activations; only its input is kept. The block's ``forward`` is replaced on the instance rather than
wrapping the module, so parameter names (and therefore checkpoints) do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with keyword arguments, inputs that do not require grad and FSDP2's hooks.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: Optional[str], every: int = 2) -> list[int]:
    """Checkpoint ``blocks`` in place.

    Args:
        blocks: the trunk's blocks in order.
        mode: ``None`` (nothing), ``"full"`` (every block) or ``"selective"`` (every ``every``-th block, starting
            with the first).
        every: the period for ``"selective"``.

    Returns:
        indices of the checkpointed blocks.
    """
    if mode is None:
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; choose 'full' or 'selective'")
    period = 1 if mode == "full" else every
    picked = [i for i in range(len(blocks)) if i % period == 0]
    for i in picked:
        block = blocks[i]
        if getattr(block, "_lp_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
        block._lp_checkpointed = True  # type: ignore[assignment]
    return picked
