"""`ReplicaCheck`: every N optimizer steps, the parameters several ranks must hold identically are compared.

`ParallelStrategy(check_replicas_every=N)` installs it; it can also be passed to the Trainer directly (any
strategy, DeepSpeed's included). The comparison is `lightning_par.guards.check_replicas`; a divergence stops the
run on every rank with `lightning_par.guards.ReplicasDiverged`, before the checkpoint callbacks of that step save
the diverged weights (Lightning runs checkpoint callbacks last).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_par.guards.replicas import check_replicas


class ReplicaCheck(Callback):
    """Compare replicated parameters across ranks after every ``every_n_steps``-th optimizer step.

    Args:
        every_n_steps: the period, in optimizer steps (under local SGD, a multiple of ``sync_every``: replicas
            differ by design between synchronisations).

    Attributes:
        seconds: the wall time of each check on this rank (the cost: docs/benchmarks.md, "Replica check").
        compared: how many parameter pieces the last check found held by more than one rank.
    """

    def __init__(self, every_n_steps: int) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int (e.g. 100)")
        self.every = every_n_steps
        self.seconds: list[float] = []
        self.compared = 0
        self._last = 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        # Once per optimizer step (a batch that only accumulates leaves the step where it was).
        if step == self._last or step % self.every or not dist.is_initialized():
            return
        self._last = step
        run = getattr(trainer.strategy, "parallel_run", None)
        start = time.perf_counter()
        if run is None:
            self.compared = check_replicas(pl_module, step=step)
        else:
            run.wait_params()  # ZeRO-1/2 may still be gathering the new weights
            self.compared = check_replicas(run.module, run.distribute_model(), names=run.one_process_names(), step=step)
        self.seconds.append(time.perf_counter() - start)


def replica_check(every: Optional[int], sync_every: Optional[int]) -> Optional[ReplicaCheck]:
    """The check a strategy's ``check_replicas_every`` asks for, validated against its local SGD period.

    Raises:
        ValueError: a period that is not a positive int, or not a multiple of ``sync_every`` (between
            synchronisations local SGD's replicas differ by design), naming the fix.
    """
    if every is None:
        return None
    if sync_every is not None and isinstance(every, int) and every % sync_every:
        raise ValueError(
            f"check_replicas_every={every} under local SGD (sync_every={sync_every}): replicas differ between "
            f"synchronisations by design; use a multiple of sync_every, e.g. "
            f"check_replicas_every={sync_every * max(1, every // sync_every)}"
        )
    try:
        return ReplicaCheck(every)
    except ValueError as err:
        raise ValueError(f"check_replicas_every: {err}") from None
