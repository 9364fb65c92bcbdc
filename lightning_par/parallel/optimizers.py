"""Which optimizers are right on ZeRO-1/2 shards.

ZeRO-1/2 step the optimizer on plain row slices of each weight (`zero_replicated.ReplicatedZero`). That gives the
one-process update exactly when the update of an element depends only on that element's gradient and state; an
optimizer that reduces over a whole matrix computes something else on a slice, with no error, so it is refused
there. Under ZeRO-3 the parameters are DTensors and such reductions span the whole weight: an optimizer that can
step DTensors is right there (torch's Muon; `tests/test_optimizers.py`).
"""

from __future__ import annotations

import torch

# Optimizers whose update of an element depends on that element's gradient and state alone: stepping each rank on a
# row slice of every weight gives the one-process update exactly. Not here: torch.optim.Adafactor (second moments
# factored over rows and columns), Muon (orthogonalizes each whole matrix), LBFGS (a line search over everything),
# SparseAdam (sparse gradients), and any optimizer we do not know.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
)  # fmt: skip
# A class attribute an optimizer sets to declare its update element-wise (its own or a subclass's `step`).
ELEMENTWISE_MARK = "lightning_par_elementwise"


def check_elementwise(optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse an optimizer whose update is not known to be element-wise, naming the fixes.

    Exact classes only (a subclass may override ``step``), or a class that declares ``lightning_par_elementwise =
    True``.

    Args:
        optimizer: what ``configure_optimizers`` returned.
        where: the layout and what it steps the optimizer on, e.g. ``"zero_stage=1: each rank steps the optimizer
            on a row slice of every weight"``.

    Raises:
        ValueError: naming the optimizer, why, and the fixes.
    """
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS or getattr(cls, ELEMENTWISE_MARK, False):
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    raise ValueError(
        f"{name} under {where}, and {cls.__name__}'s update is not known to be element-wise (an update that "
        "factors or normalizes over a whole matrix, such as Adafactor's or Muon's, would silently differ from one "
        "process). Use zero_stage=0 (every rank steps whole weights), or native zero_stage=3 (strategy='zero3') if "
        "the optimizer can step DTensors: FSDP2 keeps parameters as DTensors, so its reductions span each whole "
        "weight (torch's Muon can; torch 2.13's Adafactor cannot, an in-place op on a partial DTensor). If "
        f"{cls.__name__}'s update of each element depends only on that element, declare it with "
        f"`{cls.__name__}.{ELEMENTWISE_MARK} = True`"
    )
