"""The window between a ZeRO-1/2 optimizer step and the next forward, while the parameter all-gather runs.

`lightning_par.parallel.zero.prefetch` starts the all-gather after ``optimizer.step()`` and waits for each trunk
block's weights in that block's forward. Every hook of user code that Lightning runs in between must still see the
new weights: the callback here, first in ``trainer.callbacks``, waits for all of them before the first such hook
(Lightning calls callbacks in list order, then the LightningModule's hook). Hooks that only Lightning's own
callbacks implement, and that read no weights (progress bars, the learning-rate monitor, ...), do not make it
wait: the all-gather then overlaps the batch fetch, those hooks and the forward. A LightningModule that overrides
``optimizer_step`` or ``lr_scheduler_step``, or optimizes manually, runs its code right after the step, where no
hook can wait: the all-gather is then not deferred at all. Checkpoints, validation and the end of training wait
in the strategy.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_par.parallel.run import ParallelRun

# Lightning's callbacks whose batch hooks read no parameter values. ModelCheckpoint saves through the strategy,
# which waits itself.
_READ_NO_WEIGHTS = tuple(
    f"lightning.pytorch.callbacks.{m}"
    for m in ("progress", "lr_monitor", "timer", "model_checkpoint", "early_stopping", "throughput_monitor",
              "device_stats_monitor", "gradient_accumulation_scheduler", "model_summary", "rich_model_summary")
)  # fmt: skip
_BATCH_HOOKS = ("on_train_batch_end", "on_train_batch_start")
_RIGHT_AFTER_STEP = ("optimizer_step", "lr_scheduler_step")


def _user_code(obj: object, hook: str, base: type) -> bool:
    """Whether ``obj`` runs code of its own in ``hook``: overridden, and not by a callback known to read no weights
    (one of Lightning's above, or a class that declares ``lightning_par_reads_weights = False``)."""
    if getattr(obj, "lightning_par_reads_weights", True) is False:
        return False
    fn = getattr(type(obj), hook, None)
    if fn is None or fn is getattr(base, hook):
        return False
    return not getattr(fn, "__module__", "").startswith(_READ_NO_WEIGHTS)


class ParamsReady(Callback):
    """Waits for the deferred parameter all-gather before the hooks of user code between step and forward.

    Args:
        run: the parallelized model's run (its `ParallelRun.wait_params`).
        wait_in: the batch hooks in which some later callback, or the LightningModule, runs user code.
    """

    def __init__(self, run: ParallelRun, wait_in: frozenset[str]) -> None:
        self.run = run
        self.wait_in = wait_in

    @staticmethod
    def install(trainer: pl.Trainer, module: pl.LightningModule, run: ParallelRun) -> bool:
        """Defer the all-gather if the hooks allow it, and put the waiting callback first. Returns whether it is on."""
        callbacks: list[Callback] = [c for c in trainer.callbacks if not isinstance(c, ParamsReady)]  # type: ignore[attr-defined]
        trainer.callbacks = callbacks  # type: ignore[attr-defined]
        # Manual optimization: training_step itself runs on after optimizer.step().
        after_step = any(_user_code(module, h, pl.LightningModule) for h in _RIGHT_AFTER_STEP)
        if not module.automatic_optimization or after_step:
            return run.defer_param_gather(False)
        if not run.defer_param_gather(True):
            return False
        wait_in = frozenset(
            h for h in _BATCH_HOOKS
            if _user_code(module, h, pl.LightningModule) or any(_user_code(c, h, Callback) for c in callbacks)
        )  # fmt: skip
        callbacks.insert(0, ParamsReady(run, wait_in))
        return True

    def _wait_if(self, hook: str) -> None:
        if hook in self.wait_in:
            self.run.wait_params()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._wait_if("on_train_batch_end")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._wait_if("on_train_batch_start")

    # Rare and outside the step loop's hot path: always wait.
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.wait_params()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.wait_params()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.wait_params()
