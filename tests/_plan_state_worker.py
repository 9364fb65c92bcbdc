"""Train Hugging Face models under lightning_par strategies and measure, on every rank, what the planner predicts:
parameter, gradient and optimizer-state bytes held, and the bytes of every collective of one optimizer step.

``python -m torch.distributed.run --nproc-per-node N tests/_plan_state_worker.py SPEC.json``: SPEC has ``out`` (a
.pt path written by global rank 0) and ``jobs``, each a dict with ``config`` (a Hugging Face config as a dict,
``model_type`` included), ``strategy`` (`lightning_par.ParallelStrategy` keyword arguments), ``precision``,
``optimizer`` (``"adamw"`` or ``"sgd"``), ``aux`` (train on the model's own loss, router load-balancing term
included), ``batch`` (samples per data-parallel rank) and ``seq``. Every job trains two steps; the second is
measured (the first carries one-off traffic: FSDP2's lazy set-up, the pipeline's shape probe). Results: per job,
one dict per global rank. Bytes held are those of distinct tensor storages (padding of FSDP2 shards and ZeRO
buckets included).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.parallel.comm_counter import CommCounter  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

MEASURED = 1  # batch index of the measured step (a job may name another)


def build(config: dict[str, Any]) -> torch.nn.Module:
    """The Hugging Face causal LM of ``config`` (a dict with ``model_type``), initialised, not downloaded; with
    ``lora`` (peft ``LoraConfig`` arguments) wrapped by peft's ``get_peft_model``, its base frozen."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "lora")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **kwargs))
    if "lora" in config:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**config["lora"]))
    return model


class LM(L.LightningModule):
    """A user's LightningModule around a Hugging Face model: no logging (its scalars would be traffic too)."""

    def __init__(self, config: dict[str, Any], optimizer: str, aux: bool) -> None:
        super().__init__()
        self.model = build(config)
        self.optimizer, self.aux = optimizer, aux

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.aux:  # the model's own loss: cross-entropy plus its routers' load-balancing term
            return self.model(input_ids=x, labels=x).loss
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; views counted once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        for inner in _inner(local):
            storage = inner.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a wrapper subclass holds (fp8 training's weights wrap their fp32 values), or ``t`` itself."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for name in names for x in _inner(getattr(t, name))]


class Measure(L.Callback):
    """Tags the measured step for the counter and records what each rank holds around it."""

    def __init__(self, counter: CommCounter, measured: int) -> None:
        self.counter, self.measured = counter, measured
        self.got: dict[str, Any] = {"gradients": 0}

    def _grads(self, module: Any, trainer: L.Trainer) -> int:
        # The model's own gradients and the optimizer's (ZeRO 1-2 masters hold the reduced shards), and what
        # PowerSGD keeps for them (each bucket's error, its P and Q).
        params = [*module.parameters(), *(p for o in trainer.optimizers for g in o.param_groups for p in g["params"])]
        compression = getattr(getattr(trainer.strategy.parallel_run, "zero", None), "compression", None)
        kept = [] if compression is None else [d.values() for d in (compression.state.error_dict,
                                                                    compression.state.p_memory_dict,
                                                                    compression.state.q_memory_dict)]  # fmt: skip
        return storage_bytes(p.grad for p in params) + storage_bytes(t for d in kept for t in d)

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "step" if batch_idx == self.measured else f"step{batch_idx}"
        zero = getattr(trainer.strategy.parallel_run, "zero", None)
        if batch_idx == self.measured and getattr(zero, "compression", None) is not None:
            # PowerSGD reduces after the backward, before Lightning's on_after_backward: its peak (every full
            # gradient, with the error and factors kept from the last step) is just before that reduction.
            reduce = zero.reduce_gradients

            def measured_reduce() -> None:
                self.got["gradients"] = max(self.got["gradients"], self._grads(module, trainer))
                reduce()

            zero.reduce_gradients = measured_reduce

    def on_after_backward(self, trainer: L.Trainer, module: Any) -> None:
        if trainer.global_step == self.measured:
            self.got["gradients"] = max(self.got["gradients"], self._grads(module, trainer))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.measured:
            self.got["gradients"] = max(self.got["gradients"], self._grads(module, trainer))

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "after"
        if batch_idx != self.measured:
            return
        self.got["parameters"] = storage_bytes(module.parameters())
        states = trainer.optimizers[0].state.values()
        self.got["optimizer"] = storage_bytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = LM(job["config"], job["optimizer"], job["aux"])
    counter = CommCounter(small=0)
    measured = job.get("measured", MEASURED)
    measure = Measure(counter, measured)
    world = int(os.environ["WORLD_SIZE"])  # set by torchrun; the process group starts inside fit
    counter.install()
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(**job["strategy"]),
            precision=job["precision"], max_steps=measured + 1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[measure],
        )  # fmt: skip
        data = ByteTextDataModule(seq_len=job["seq"], batch_size=job["batch"], num_samples=64 * world)
        trainer.fit(model, datamodule=data)
    finally:
        counter.uninstall()
    return {**measure.got, "comm": counter.per_kind("step")}


def main() -> None:
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(sys.argv[1]).read_text())
    mine = [run_job(job) for job in spec["jobs"]]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        torch.save([[ranks[r][j] for r in range(len(ranks))] for j in range(len(spec["jobs"]))], spec["out"])
    clean_exit()


if __name__ == "__main__":
    main()
