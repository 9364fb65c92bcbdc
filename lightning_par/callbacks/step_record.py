"""`StepRecord`: what `lightning-par verify` compares, written by each of its two runs.

After every optimizer step: the step's loss (the mean over the global batch: this rank's micro-batch losses, each
already divided by the accumulation, summed, then averaged over the data-parallel ranks), the global gradient norm
(over every stage and shard), and a checkpoint of the whole state through the strategy's own saving (so it works
under every layout), in ``out/step=<k>``. Rank 0 writes ``out/steps.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_par.parallel.grad_norm import global_grad_norm


class StepRecord(Callback):
    """Record each optimizer step's loss and gradient norm, and save the state after it.

    Args:
        out: the folder for ``steps.json`` and the ``step=<k>`` checkpoints (never the user's checkpoint folder).
        save: also save a checkpoint after every step (what per-step parameter comparisons need).
    """

    def __init__(self, out: str, save: bool = True) -> None:
        self.out, self.save = Path(out), save
        self.steps: list[dict[str, Any]] = []
        self._loss = 0.0
        self._norm = float("nan")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = getattr(trainer.strategy.precision_plugin, "norm_groups", ())  # pipeline stages
        self._norm = float(global_grad_norm(params, groups))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._loss += float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if trainer.global_step == len(self.steps):  # a batch that only accumulated
            return
        local = torch.tensor(self._loss, dtype=torch.float64, device=pl_module.device)
        mean = trainer.strategy.reduce(local, reduce_op="mean")
        self.steps.append({"step": trainer.global_step, "loss": float(mean), "grad_norm": self._norm})
        self._loss = 0.0
        if self.save:
            trainer.save_checkpoint(self.out / f"step={trainer.global_step}")
        if trainer.is_global_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "steps.json").write_text(json.dumps(self.steps, indent=1))
