"""`JobWatchdog`: the Lightning side of `lightning_par.guards.watchdog` (hang reports, lost ranks named).

`ParallelStrategy(watchdog=...)` installs it (on by default); it can also be passed to the Trainer under another
strategy. It times each training batch, adds to a failing rank's error the rank that caused it (the one that failed
first, or one that was lost), and stops its thread when the run ends.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_par import _compat
from lightning_par.callbacks.replicas import replica_check
from lightning_par.guards.blocked import group_names
from lightning_par.guards.watchdog import Watchdog


class JobWatchdog(Callback):
    """Ends a stuck run with a report of where every rank is, and names a lost rank.

    Args:
        hang_after_s: a training batch running longer than this many seconds is a hang; ``None``: 10 x the median
            batch so far, at least 60 s, and until 3 batches are timed ``first_steps_s``.
        first_steps_s: the limit of the first batches (compilation, warm-up); the strategy passes 0.9 x its
            collective timeout, so that the report comes before the backend's own error.
        lost_after_s: a rank silent this long, without having ended, is lost.
    """

    lightning_par_reads_weights = False  # its batch hooks read no parameter

    def __init__(self, hang_after_s: Optional[float] = None, first_steps_s: float = 540.0,
                 lost_after_s: float = 5.0) -> None:  # fmt: skip
        if hang_after_s is not None and hang_after_s <= 0:
            raise ValueError(f"hang_after_s={hang_after_s} must be > 0 seconds (or None: 10 x the median step)")
        self.settings = {"hang_after_s": hang_after_s, "first_steps_s": first_steps_s, "lost_after_s": lost_after_s}
        self.dog: Optional[Watchdog] = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (Not `setup`: the strategy installs this callback in its own set-up, after the callbacks' `setup` ran.)
        if self.dog is not None or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        try:
            names = group_names(trainer.strategy.meshes)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # a strategy without our meshes: groups named by their ranks
            names = {}
        self.dog = Watchdog(_compat.default_store(), dist.get_rank(), dist.get_world_size(), names,
                            **self.settings)  # type: ignore[arg-type]  # fmt: skip
        self.dog.start()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.dog is not None:
            self.dog.step_started(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.dog is not None:
            self.dog.step_ended()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.dog is None:
            return
        note = self.dog.explain(exception)
        self.dog = None
        if note:
            exception.add_note(f"lightning_par: {note}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dog is not None and stage == "fit":
            self.dog.stop()
            self.dog = None


def guard_callbacks(check_replicas_every: Optional[int], sync_every: Optional[int], watchdog: Union[bool, float],
                    timeout_s: float) -> list[Callback]:  # fmt: skip
    """The callbacks a strategy's guard arguments ask for (`ReplicaCheck`, `JobWatchdog`), validated.

    Args:
        check_replicas_every, sync_every: see `replica_check`.
        watchdog: ``True``: hang limit from the median step; a number: the limit in seconds; ``False``: off.
        timeout_s: the collective timeout (the first steps' limit is 0.9 x this).
    """
    found: list[Callback] = []
    check = replica_check(check_replicas_every, sync_every)
    if check is not None:
        found.append(check)
    if watchdog is not False:
        if isinstance(watchdog, bool):
            found.append(JobWatchdog(first_steps_s=0.9 * timeout_s))
        elif isinstance(watchdog, (int, float)):
            found.append(JobWatchdog(float(watchdog), first_steps_s=0.9 * timeout_s))
        else:
            raise ValueError(f"watchdog={watchdog!r}: pass True, False or a number of seconds")
    return found


def install(trainer: pl.Trainer, callbacks: list[Callback]) -> None:
    """Put ``callbacks`` first in the trainer's callbacks (once): before the checkpoint callbacks of a step."""
    for callback in reversed(callbacks):
        if callback not in trainer.callbacks:  # type: ignore[attr-defined]
            trainer.callbacks.insert(0, callback)  # type: ignore[attr-defined]

