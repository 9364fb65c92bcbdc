"""Checks of context parallelism that run before training, on the whole model."""

from __future__ import annotations

from torch import nn

from lightning_par.blocks._probe import block_order, out_of_order
from lightning_par.blocks.trunk import Trunk


def check_blocks_run_once(module: nn.Module, trunk: Trunk) -> None:
    """Refuse, before training, a model whose forward runs a trunk block again or out of order (a recurrent-depth
    loop: Hugging Face HRM runs its ``L_module`` six times, some of them under ``torch.no_grad``, where the check at
    the first forward, which follows the autograd graph, cannot see it).

    Raises:
        NotImplementedError: naming the order the probe saw and the fix.
    """
    order = block_order(module, trunk.blocks)
    if order and (shown := out_of_order(order)):
        raise NotImplementedError(
            f"the forward calls the blocks of {trunk.path} in the order {shown}: a block runs again (a loop over "
            "part or all of the trunk) or out of order; context parallelism cuts the sequence where the trunk starts "
            "and gathers it after its last block, once per forward; train this model without it (e.g. "
            "strategy='zero3')"
        )
