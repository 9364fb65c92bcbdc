"""One trial of `lightning-par sweep`: the recipe, run by LightningCLI, with a callback that appends every
validation's metric to a file, which the sweep reads to report and prune.

``python -m lightning_par.tuning.trial METRICS_FILE METRIC [LightningCLI arguments, e.g. --config RECIPE --k=v]``.
Lightning's own launcher re-runs this command for the other ranks of a multi-device recipe; rank 0 writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L


class MetricsFile(L.Callback):
    """Append ``{"step": global_step, "value": metric}`` to ``path`` after each validation (rank 0; not in the
    sanity check)."""

    def __init__(self, path: Path, metric: str) -> None:
        self.path, self.metric = Path(path), metric

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:  # what the run starts from: its step and its first group's lr
            row = {"start_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if trainer.sanity_checking or not trainer.is_global_zero or value is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "value": float(value)}) + "\n")


class NewHyperparameters(L.Callback):
    """After a resume, the optimizer's hyper-parameters (lr, weight decay, betas, ...) are this run's: its state
    (moments, step) comes from the checkpoint, but its param groups' settings from the model's own
    ``configure_optimizers`` with this run's arguments; a scheduler keeps its position (the factor it applies now)
    on the new base lr.
    Population-based training explores this way: a trial continues another's checkpoint with perturbed values."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from lightning_par.analysis.compatibility import first_optimizer

        new = first_optimizer(pl_module.configure_optimizers())  # the first optimizer's settings (the one PBT tunes)
        for restored in trainer.optimizers[:1] if new is not None else []:
            for group, new_group in zip(restored.param_groups, new.param_groups):  # type: ignore[union-attr]
                # Where the restored schedule stands, as a factor of its base lr (1 without a scheduler).
                factor = group["lr"] / group["initial_lr"] if group.get("initial_lr") else 1.0
                group.update({k: v for k, v in new_group.items() if k != "params"})
                group["initial_lr"] = new_group["lr"]
                group["lr"] = new_group["lr"] * factor
        for config in trainer.lr_scheduler_configs:
            scheduler: Any = config.scheduler
            scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]


def main(argv: Optional[list[str]] = None) -> None:
    """Run one trial (module docstring). ``--resume CKPT`` (before the LightningCLI arguments) continues a checkpoint
    with this trial's hyper-parameters (`NewHyperparameters`); ``--save CKPT`` saves one at the end."""
    from lightning_par.cli_recipe import build_cli

    path, metric, *args = sys.argv[1:] if argv is None else argv
    resume = save = None
    while args and args[0] in ("--resume", "--save"):
        flag, value, *args = args
        resume, save = (value, save) if flag == "--resume" else (resume, value)
    cli = build_cli(args, run=False)
    callbacks = cli.trainer.callbacks  # type: ignore[attr-defined]
    if resume is not None:
        callbacks.append(NewHyperparameters())  # before MetricsFile, which records the lr the run starts with
    callbacks.append(MetricsFile(Path(path), metric))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=resume)
    if save is not None:
        cli.trainer.save_checkpoint(save)


if __name__ == "__main__":
    main()
