"""Fabric loops under lightning_par layouts, one after another in the ranks torchrun started (argument: SPEC).

SPEC is a JSON file ``{"out": PATH, "jobs": [job, ...]}``. A job trains a Hugging Face model (built from a config, no
download) with a plain Fabric loop: ``fabric.setup(model, optimizer)``, ``fabric.backward``, optionally
``fabric.no_backward_sync`` (accumulation) and ``fabric.clip_gradients``, ``fabric.all_reduce`` of the loss. Each rank
trains on its data-parallel slice of one global batch per step. ``strategy`` ``null`` is the one-process reference: the
same loop in plain PyTorch on the whole batch. Rank 0 writes per job the losses, gradient norms and full weights.

Job keys: ``name``, ``strategy`` (a name, ``{"kwargs": {...}}`` for ``FabricParallelStrategy(...)``, or ``null``),
``model`` (``llama`` / ``mixtral``), ``steps``, ``accumulate`` (microbatches per step), ``clip`` (max norm),
``save`` (folder: save after the steps), ``load`` (folder: load before training), ``trainer_save`` (folder: train
``steps`` with the Trainer under ``strategy`` and save there), ``trainer_checkpoint`` (``load`` is the Trainer's:
no ``step`` entry), ``first_step``, ``precision``, ``errors`` (record the refusals' messages), ``meta`` (build under
``fabric.init_module()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import lightning_par
from lightning_par.checkpoint import full_tensor
from lightning_par.checkpoint.dcp import model_state
from lightning_par.parallel.flops import active_param_count

GLOBAL_BATCH, SEQ = 8, 16


class LM(L.LightningModule):
    """The model under test: a Hugging Face causal LM; a LightningModule so that the Trainer can train it too."""

    def __init__(self, kind: str = "llama") -> None:
        super().__init__()
        from _hf_models import _llama
        from _job_models import HFMixtralLM

        self.model = _llama(2) if kind == "llama" else HFMixtralLM.build()

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return _loss(self, batch)

    def configure_optimizers(self) -> Any:
        return _optimizer(self)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _loss(model: Any, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _slice(batch: tuple[Tensor, Tensor], part: int, parts: int) -> tuple[Tensor, Tensor]:
    n = batch[0].shape[0] // parts
    return batch[0][part * n : (part + 1) * n], batch[1][part * n : (part + 1) * n]


def _full(module: nn.Module, run: Any) -> dict[str, Tensor]:
    state = model_state(module, run.distribute_model() if run is not None else None)
    full = {k: full_tensor(v) for k, v in state.items()}  # explicit collectives for ZeRO-3 over tp (strided.py)
    return {k: v.detach().float().cpu().clone() for k, v in full.items()}


def _strategy(job: dict[str, Any]) -> Any:
    spec = job["strategy"]
    if isinstance(spec, dict):
        return lightning_par.FabricParallelStrategy(**spec["kwargs"])
    return spec


def _reference(job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LM(job["model"])
    opt = _optimizer(model)
    init = _full(model, None)  # the starting point (tests/parity.py's wrong_share)
    losses, norms = [], []
    autocast = torch.autocast("cpu", torch.bfloat16, cache_enabled=False)
    for step in range(job["steps"]):
        parts = job.get("accumulate", 1)
        total = 0.0
        for micro in range(parts):
            with autocast if job.get("precision") == "bf16-mixed" else contextlib.nullcontext():
                loss = _loss(model, _slice(_batch(step), micro, parts)) / parts
            loss.backward()
            total += loss.item()
        if job.get("clip"):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job["clip"]).item())
        opt.step()
        if not job.get("keep_grads"):  # keep_grads: gradients add up over the steps, as no zero_grad leaves them
            opt.zero_grad()
        losses.append(total)
    flops = active_param_count(model)
    return {"losses": losses, "norms": norms, "params": _full(model, None), "flops_params": flops, "init_state": init}


def _fabric(job: dict[str, Any], world: int) -> dict[str, Any]:
    precision = job.get("precision", "32-true")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=_strategy(job), precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True) if job.get("meta") else contextlib.nullcontext():
        model = LM(job["model"])  # on the meta device under init_module: each rank creates its share in setup
    opt = _optimizer(model)
    model, opt = fabric.setup(model, opt)
    strategy = fabric.strategy
    run = strategy.parallel_run
    out: dict[str, Any] = {"layout": strategy.parallel_layout, "flops_params": strategy.global_param_count}
    if job.get("meta"):
        local = [(p.to_local() if isinstance(p, DTensor) else p) for p in run.module.parameters()]
        out["meta_left"] = sum(p.is_meta for p in local)
        out["held_fraction"] = sum(p.numel() for p in local) / sum(p.numel() for p in run.module.parameters())
        out["init_params"] = _full(run.module, run)
    if job.get("load"):
        state = {"model": model, "optimizer": opt, **({} if job.get("trainer_checkpoint") else {"step": 0})}
        out["remainder"] = sorted(fabric.load(job["load"], state))
        out["loaded_step"] = state.get("step")
        out["loaded_params"] = _full(run.module, run)
    sampler = strategy.distributed_sampler_kwargs
    dp, dp_rank = sampler["num_replicas"], sampler["rank"]
    losses, norms = [], []
    first = job.get("first_step", 0)
    for step in range(first, first + job["steps"]):
        parts = job.get("accumulate", 1)
        local = _slice(_batch(step), dp_rank, dp)
        total = torch.zeros(())
        for micro in range(parts):
            with fabric.no_backward_sync(model, enabled=micro < parts - 1):
                loss = _loss(model, _slice(local, micro, parts)) / parts
                fabric.backward(loss)
            total += loss.detach()
        if job.get("clip"):
            norms.append(fabric.clip_gradients(model, opt, max_norm=job["clip"]).item())
        opt.step()
        if not job.get("keep_grads"):
            opt.zero_grad()
        losses.append(fabric.all_reduce(total, reduce_op="mean").item())  # the data-parallel ranks' mean
    out.update(losses=losses, norms=norms, params=_full(run.module, run))
    if job.get("save"):
        fabric.save(job["save"], {"model": model, "optimizer": opt, "step": job["steps"], "note": "fabric"})
    if job.get("errors"):
        out["errors"] = _errors(fabric, model)
    return out


def _errors(fabric: L.Fabric, model: Any) -> dict[str, str]:
    """What a second model and an optimizer that already stepped get: the messages."""
    errors = {}
    for name, call in (
        ("second_model", lambda: fabric.setup(LM("llama"))),
        ("stepped_optimizer", lambda: _stepped_rebind(model)),
        ("load_without_state", lambda: fabric.load(fabric.broadcast(os.getcwd()))),
    ):
        try:
            call()
            errors[name] = ""
        except (ValueError, RuntimeError) as err:
            errors[name] = str(err)
    return errors


def _stepped_rebind(model: Any) -> None:
    from lightning_par.parallel.rebind import parameter_names, rebind_optimizer

    plain = nn.Linear(2, 2)
    opt = torch.optim.AdamW(plain.parameters())
    plain(torch.ones(1, 2)).sum().backward()
    opt.step()
    rebind_optimizer(opt, parameter_names(plain), plain)


class _TrainerLM(LM):
    """`LM` whose loader gives each data-parallel rank its slice of the same global batches, in order."""

    def __init__(self, kind: str, steps: int) -> None:
        super().__init__(kind)
        self.steps = steps

    def train_dataloader(self) -> Any:
        dp_mesh = self.trainer.strategy.meshes.dp
        dp, rank = dp_mesh.size(), dp_mesh.get_local_rank()
        batches = [_slice(_batch(step), rank, dp) for step in range(self.steps)]
        return torch.utils.data.DataLoader(batches, batch_size=None)


def _trainer(job: dict[str, Any], world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=job["strategy"], max_steps=job["steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)  # fmt: skip
    trainer.fit(_TrainerLM(job["model"], job["steps"]))
    trainer.save_checkpoint(job["trainer_save"])
    run = trainer.strategy.parallel_run
    return {"params": _full(run.module, run), "steps": trainer.global_step}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    warnings.filterwarnings("ignore")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    results: dict[str, Any] = {}
    for job in spec["jobs"]:
        if job["strategy"] is None:
            results[job["name"]] = _reference(job) if int(os.environ.get("RANK", "0")) == 0 else {}
        elif job.get("trainer_save"):
            results[job["name"]] = _trainer(job, world)
        else:
            results[job["name"]] = _fabric(job, world)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, spec["out"])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
