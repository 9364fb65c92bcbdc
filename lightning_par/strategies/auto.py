"""``Trainer(strategy="auto_parallel")``: the planner chooses the layout at start-up, for the actual model, world
size and batch, among the layouts the model can run, and the strategy runs it.

When: in `setup`, after Lightning has run the data module's and the model's ``setup`` and ``configure_model``
(the model and the data exist) and before the model is laid out. The processes were joined earlier with plain data
parallelism; the chosen layout is resolved against the same world and gets its own mesh. What: the first batch of
the training data gives the per-rank batch and the sequence length; `lightning_par.planner.introspect` describes the
model; `lightning_par.analysis.compatibility.check_model` says which dimensions it supports (the layouts it cannot
run are ruled out with that reason); the device is a known GPU or this CPU job measured
(`strategies/_auto_device.py`); layouts are ranked by predicted time per sample. The top three and what separates
them are printed. Every rank picks the same layout (one rank's measurements, broadcast).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par.analysis.compatibility import check_model, first_optimizer
from lightning_par.axes import AXIS_NAMES, MODEL_AXES
from lightning_par.config import ParallelConfig
from lightning_par.names import name_of
from lightning_par.parallel.tensor import infer_tp_plan
from lightning_par.parallel.tensor.plan_types import TPPlanError
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.planner.estimate import Estimate
from lightning_par.planner.introspect import desc_from_module
from lightning_par.planner.layout import Layout
from lightning_par.planner.params import specs_from_module
from lightning_par.planner.search import Ranking, candidates, rank_layouts
from lightning_par.strategies._auto_device import this_device
from lightning_par.strategies.parallel import ParallelStrategy

# What the planner decides; the rest of ParallelStrategy's arguments pass through.
_CHOSEN = (*AXIS_NAMES, "zero_stage", "activation_checkpointing", "sequence_parallel", "pp_schedule", "microbatches",
           "auto_dims", "offload")  # fmt: skip
_PRECISION = {"32-true": "32-true", "32": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed",
              "bf16-true": "bf16-true"}  # fmt: skip


def layout_name(layout: Layout) -> str:
    """The registered strategy name with the same dimensions (what `check_model` gives a verdict on)."""
    return name_of({axis: getattr(layout, axis) for axis in MODEL_AXES}, layout.zero_stage)


def explain(ranking: Ranking, top: int = 3) -> list[str]:
    """The top layouts, one line each, and for each runner-up the part of the step that costs it most."""
    best = ranking.feasible[:top]
    lines = []
    for i, est in enumerate(best, 1):
        t = est.time
        line = f"#{i} {est.layout.describe()}: {t.total * 1e3:.1f} ms/step, {est.total / 2**30:.2f} GiB"
        if i > 1:
            parts = _parts(est)
            worst = max(parts, key=lambda k: parts[k] - _parts(best[0])[k])
            line += (
                f" (slower than #1 by its {worst}: {parts[worst] * 1e3:.1f} vs {_parts(best[0])[worst] * 1e3:.1f} ms)"
            )
        lines.append(line)
    return lines


def _parts(est: Estimate) -> dict[str, float]:
    t = est.time
    return {"compute": t.compute, "tensor-parallel communication": t.tp_comm, "pipeline bubble": t.pipeline_bubble,
            "data-parallel communication": t.dp_comm_exposed, "optimizer step": t.optimizer}  # fmt: skip


class AutoParallelStrategy(ParallelStrategy):
    """`ParallelStrategy` whose layout the planner chooses at start-up (module docstring).

    Args:
        gpu: plan for this GPU of the planner's table instead of the one found (or the CPU measured).
        top: how many of the best layouts to print.
        **kwargs: `ParallelStrategy`'s other arguments (timeouts, checkpointing, compile, ...); the layout's own
            (tp, pp, zero_stage, ...) are the planner's to choose and are refused.
    """

    def __init__(self, gpu: Optional[str] = None, top: int = 3, **kwargs: Any) -> None:
        chosen = sorted(set(kwargs) & set(_CHOSEN))
        if chosen:
            raise ValueError(
                f"auto_parallel chooses {chosen} itself; drop them, or set the layout by hand with "
                "lightning_par.ParallelStrategy(...)"
            )
        super().__init__(zero_stage=0, **kwargs)  # plain data parallelism until the plan is made
        self._gpu = gpu
        self._top = top
        self.ranking: Optional[Ranking] = None
        self.chosen: Optional[Layout] = None
        self.registered_name = "auto_parallel"

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.chosen is None:
            self._choose(trainer)
        super().setup(trainer)

    def _choose(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        x = _first_tensor(_first_batch(trainer, module))
        if x is None or x.ndim < 2:
            raise ValueError("auto_parallel reads the batch size and sequence length from the first training batch "
                             "(a [batch, seq] tensor); give the model a training dataloader")  # fmt: skip
        per_rank, seq = int(x.shape[0]), int(x.shape[1])
        world = self.cluster_environment.world_size() if self.cluster_environment else 1
        dev = this_device(self.root_device, world, self.num_processes, self._gpu)
        desc = desc_from_module(module)
        verdicts = {v.strategy: v for v in check_model(module, first_optimizer(module.configure_optimizers()))}
        precision = _PRECISION.get(str(getattr(self.precision_plugin, "precision", "32-true")), "32-true")
        pool, refused = [], []
        tp_ok = _tp_degrees(module, world)
        for layout, batch in candidates(desc, world, self.num_processes, per_rank_batch=per_rank, precision=precision):
            name = layout_name(layout)
            verdict = verdicts.get(name)
            if name and (verdict is None or not verdict.ok):
                refused.append((layout, verdict.reason if verdict else f"{name} is not a strategy of this suite"))
            elif tp_ok[layout.tp]:
                refused.append((layout, tp_ok[layout.tp]))
            else:
                pool.append((layout, batch))
        ranking = rank_layouts(desc, dev, pool, seq, specs=specs_from_module(module))
        ranking.infeasible.extend(refused)
        if not ranking.feasible:
            raise ValueError(
                f"auto_parallel found no layout for this model on {world} ranks of {dev.name} that fits; add "
                "devices, lower the batch size, or choose a layout with ParallelStrategy(...)"
            )
        best = self.broadcast(ranking.feasible[0].layout)
        rank_zero_info(
            f"lightning_par auto_parallel on {world} x {dev.name}: {len(ranking.feasible)} feasible layouts, "
            f"{len(ranking.infeasible)} ruled out; chose #1"
        )
        for line in explain(ranking, self._top):
            rank_zero_info(f"lightning_par auto_parallel {line}")
        self.ranking, self.chosen = ranking, best
        kwargs = {**dataclasses.asdict(self.config), **best.strategy_kwargs()}
        kwargs.update(dp_shard=best.dp_shard, auto_dims=None)
        if best.pp == 1:
            kwargs["microbatches"] = None
        config = ParallelConfig(**kwargs).resolve(world, devices_per_node=self.num_processes)
        self.processes.relayout(config, self.root_device.type)


def _tp_degrees(module: torch.nn.Module, world: int) -> dict[int, str]:
    """Per tensor-parallel degree dividing ``world``: ``""`` when the model's inferred plan splits that way (checked
    as set-up checks it), else the reason."""
    plan = infer_tp_plan(module)
    verdicts: dict[int, str] = {}
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        try:
            validate_tp(plan, tp)
            verdicts[tp] = ""
        except TPPlanError as err:
            verdicts[tp] = str(err).splitlines()[0]
    return verdicts


def _first_batch(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    datamodule = getattr(trainer, "datamodule", None)  # set by fit(datamodule=...), typed on the fit loop only
    source = datamodule if datamodule is not None else module
    loader = source.train_dataloader()
    return next(iter(loader))


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((t for t in map(_first_tensor, items) if t is not None), None)
