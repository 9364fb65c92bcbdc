"""`ModelPart`: the unit every per-part transform of `compose.parallelize` works on.

Without a pipeline there is one part, the whole model; a pipeline cut (`pipeline.split.split_pipeline`) gives one
part per stage this rank runs. Tensor parallelism, activation checkpointing and ZeRO-3 then treat every part alike,
so the order in `compose` never needs to know which it has.
"""

from __future__ import annotations

import dataclasses

from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """A piece of the model, with its trunk blocks.

    Args:
        root: the module whose ``__call__`` runs the part's whole forward (a pipeline stage module, or a
            `lightning_par.parallel.zero.fsdp.StepRoot` around the user's module): FSDP2 makes it the part's root.
        blocks: the part's trunk blocks as (qualified name, block), in execution order.
        whole_trunk: the part holds every trunk block (no pipeline); a pipeline stage's part holds its own.
    """

    root: nn.Module
    blocks: tuple[tuple[str, nn.Module], ...]
    whole_trunk: bool

    @property
    def block_modules(self) -> list[nn.Module]:
        """The blocks alone, in order."""
        return [b for _, b in self.blocks]
