"""A training script for torchrun's elastic agents (tests/test_elastic_agent.py): ZeRO-2 with a fixed global batch,
a checkpoint after every step, resuming from the last one at every (re)start.

``python tests/_elastic_train.py OUT_DIR MAX_STEPS STEP_SLEEP_S``: rank 0 appends ``{"step", "world", "loss"}`` to
``OUT_DIR/steps.jsonl`` after each optimizer step; checkpoints go to ``OUT_DIR/ckpts``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class StepLog(L.Callback):
    lightning_par_reads_weights = False

    def __init__(self, path: Path, sleep_s: float) -> None:
        self.path, self.sleep_s = path, sleep_s

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # only whole optimizer steps are logged
            return
        if trainer.is_global_zero:
            row = {"step": trainer.global_step, "world": trainer.world_size,
                   "loss": float(trainer.callback_metrics["train_loss"])}  # fmt: skip
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        time.sleep(self.sleep_s)  # time for the test to kill a node between steps


def main() -> None:
    out, max_steps, sleep_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = int(os.environ["WORLD_SIZE"]) // local
    L.seed_everything(0, verbose=False)
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3)
    data = ByteTextDataModule(seq_len=32, batch_size=2, num_samples=8 * max_steps, seed=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=local, num_nodes=nodes, max_steps=max_steps, logger=False,
        strategy=lightning_par.ParallelStrategy(zero_stage=2, global_batch=8, timeout_s=60),
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", filename="{step}", every_n_train_steps=1, save_last=True),
                   StepLog(out / "steps.jsonl", sleep_s)],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    clean_exit()


if __name__ == "__main__":
    main()
