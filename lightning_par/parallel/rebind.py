"""Point an optimizer built before the model was laid out at the parameters the layout left.

A loop that builds its optimizer before handing model and optimizer to the strategy (Fabric's
``fabric.setup(model, optimizer)``) holds the original parameter objects. Laying the model out replaces many of them:
FSDP2 and tensor parallelism register DTensor parameters, a meta-built model gets new storage, a pipeline stage drops
other stages' parameters. This maps each old parameter to the new one of the same name, before the optimizer has
state (its first step), so hyperparameters and param groups are the user's own.
"""

from __future__ import annotations

import torch
from torch import nn


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name by object id (the first name of a tied parameter): taken before the layout."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def rebind_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, str], module: nn.Module) -> int:
    """Replace, in every param group, each parameter of ``before`` with the parameter of that name in ``module`` now.

    Args:
        optimizer: built over the module's parameters before the layout, without state yet.
        before: `parameter_names` of the module before the layout.
        module: the module after the layout.

    Returns:
        how many parameters were replaced by another object.

    Raises:
        ValueError: the optimizer already has state, or holds a tensor that is not one of the module's parameters.
    """
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state (it stepped before set-up): its state belongs to the "
            "parameters before the layout. Set the model and optimizer up before the first optimizer step"
        )
    now = dict(module.named_parameters(remove_duplicate=False))
    replaced = 0
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            name = before.get(id(p))
            if name is None:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is not a parameter of "
                    f"{type(module).__name__}; build the optimizer over model.parameters()"
                )
            new = now.get(name)
            if new is None:
                continue  # not on this rank (another pipeline stage)
            replaced += new is not p
            kept.append(new)
        group["params"] = kept
    return replaced
