"""The callbacks and logger `tests/_worker.py` puts in a job's fit: what they record (losses, gradient norms and
memory per step, MoE routing, the optimizer state and parameters at train start, parameters after each step), and
the faults and side jobs a job asks for (a SIGKILL at a step, per-rank RNG seeds, an EMA of the weights)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sys
import threading
import time
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import Logger
from torch.distributed.tensor import DTensor

import lightning_par
from lightning_par.checkpoint import full_tensor
from lightning_par.parallel.grad_norm import global_grad_norm


class EMA(L.Callback):
    """An exponential moving average of the weights, updated between the optimizer step and the next forward."""

    def __init__(self) -> None:
        self.avg: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for n, p in pl_module.named_parameters():
            w = p.detach().float().cpu()
            self.avg[n] = w.clone() if n not in self.avg else 0.5 * self.avg[n] + 0.5 * w


def local_bytes(tensors: Any) -> int:
    from lightning_par.utils.dtensors import storages

    seen, total = set(), 0
    for part in (part for t in tensors if t is not None for part in storages(t)):  # NF4: its codes and scales
        key = (part.untyped_storage().data_ptr(), part.storage_offset(), part.numel())
        if key not in seen:
            seen.add(key)
            total += part.numel() * part.element_size()
    return total


class Recorder(L.Callback):
    """Per-step loss (as logged, i.e. reduced over data-parallel ranks), grad norm and memory."""

    def __init__(self, fail_at_step: int | None = None, fail_rank: int = 1) -> None:
        self.losses: list[float] = []
        self.local_losses: list[float] = []
        self.grad_norms: list[float] = []
        self.batch_heads: list[list[int]] = []
        self.mem: dict[str, int] = {}
        self.fail_at_step, self.fail_rank = fail_at_step, fail_rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.fail_at_step is not None and batch_idx == self.fail_at_step and trainer.global_rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {trainer.global_rank} at batch {batch_idx}")

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        # What backward leaves on the model's own parameters: full gradients (ZeRO 0/1), none (ZeRO-2 reduced and
        # freed them bucket by bucket), or gradient shards (ZeRO-3, whose parameters are shards).
        held = local_bytes(p.grad for p in pl_module.parameters())
        self.mem["model_grads_after_backward"] = max(self.mem.get("model_grads_after_backward", 0), held)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # Under a pipeline each rank holds its stages' gradients only: the norm sums over the pipeline group.
        groups = getattr(getattr(trainer.strategy, "precision_plugin", None), "norm_groups", ())
        self.grad_norms.append(float(global_grad_norm(params, groups)))
        # The gradients the optimizer steps on: full (ZeRO-0) or this rank's shards (ZeRO 1-3).
        self.mem["grads"] = max(self.mem.get("grads", 0), local_bytes(p.grad for p in params))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch_heads.append(batch[0][:, 0].tolist())
        self.local_losses.append(float(outputs["loss"]))
        self.losses.append(float(trainer.callback_metrics.get("train_loss", outputs["loss"])))  # (NoLogGPT: its own)
        self.mem["params"] = local_bytes(pl_module.parameters())
        self.mem["optim"] = local_bytes(
            v for opt in trainer.optimizers for s in opt.state.values() for k, v in s.items() if k != "step"
        )


class QuietRecorder(Recorder):
    """A Recorder in no hook (``quiet`` jobs): it is not in the trainer's callbacks, only in the result's code."""


class RankSeed(L.Callback):
    """Gives every rank its own RNG streams (Lightning's strategy setup seeds all ranks alike), once the process
    group exists; a resume then restores each rank's saved streams at train start."""

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        torch.manual_seed(1000 + trainer.global_rank)
        random.seed(2000 + trainer.global_rank)
        np.random.seed(3000 + trainer.global_rank)


class RoutingRecorder(L.Callback):
    """Per step and MoE layer: router logits, chosen experts and kept (within capacity) flags of the step's tokens,
    in global batch order (rank r's local sample i is global sample i * dp + r under the DistributedSampler)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self._logits: list[torch.Tensor] = []
        self.rows = [0]

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._tp = getattr(getattr(trainer.strategy, "config", None), "tp", 1)  # tp ranks hold the same samples
        for moe in pl_module._moe_layers():
            # Rows this rank's experts compute (after the dispatch hooks: under tp x ep, this rank's share).
            moe.experts.register_forward_pre_hook(self._count_rows)
            moe.router.register_forward_hook(lambda _m, _a, out: self._logits.append(out.detach().float().clone()))

    def _count_rows(self, module: torch.nn.Module, args: Any) -> None:
        self.rows[0] += len(args[0])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._logits.clear()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        b = batch[0].shape[0]
        step = {}
        for i, moe in enumerate(pl_module._moe_layers()):
            for key, t in (("logits", self._logits[i]), ("expert", moe.stats["expert_index"]),
                           ("kept", moe.stats["kept"])):  # fmt: skip
                step[f"{i}.{key}"] = t.reshape(b, -1, t.shape[-1]).cpu().clone()
            step[f"{i}.tokens_per_expert"] = moe.stats["tokens_per_expert"].cpu().clone()
        self.steps.append(step)

    def global_order(self) -> list[dict[str, torch.Tensor]]:
        if not dist.is_initialized():
            return self.steps
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.steps)
        parts = parts[:: getattr(self, "_tp", 1)]  # one rank per tp group (tp innermost): the dp ranks' samples
        out = []
        for k, step in enumerate(parts[0]):
            merged = {}
            for key, t in step.items():
                if key.endswith("tokens_per_expert"):
                    merged[key] = t
                    continue
                # Interleave samples: global i*dp + r <- dp rank r's i (no pp under moe tests).
                stacked = torch.stack([p[k][key] for p in parts], dim=1)  # [b, dp, ...]
                merged[key] = stacked.flatten(0, 1)
            out.append(merged)
        return out


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call; Lightning calls loggers on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


# Steps ended so far and whether training is over, for the writes that wait for a step (`_job_hooks.py`).
STEP_ENDS = threading.Condition()
STEPS: dict[str, Any] = {"ended": 0, "over": False, "saves": []}  # saves: steps ended at each save call


class CheckpointRecorder(L.Callback):
    """The step a run starts at (after any resume), full parameters after each step, and how many steps ended
    while an asynchronous save was being written."""

    def __init__(self, record_params: bool) -> None:
        self.start_step = -1
        self.record_params = record_params
        self.step_params: dict[int, dict[str, torch.Tensor]] = {}
        self.steps_while_writing = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs before ModelCheckpoint's hook (Lightning puts checkpoint callbacks last): a save in flight now is one
        # started at an earlier step.
        if getattr(trainer.strategy, "checkpoint_in_flight", None) is not None:
            self.steps_while_writing += 1
        with STEP_ENDS:  # after the count: a write waiting for this step is still in flight above
            STEPS["ended"] += 1
            STEPS["over"] = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
            STEP_ENDS.notify_all()
        if self.record_params:
            self.step_params[trainer.global_step] = full_params(pl_module)


class OptimizerRecorder(L.Callback):
    """The first optimizer's state when training starts (after any resume), full tensors keyed by parameter name."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        opt = trainer.optimizers[0]
        if hasattr(trainer.strategy, "engine"):
            self.state = _deepspeed_optimizer_state(trainer.strategy, opt)
            return
        if isinstance(trainer.strategy, lightning_par.ParallelStrategy):
            named = trainer.strategy.optimizer_state(opt)["state"]  # sharded tensors as DTensors
        else:
            names = {p: n for n, p in pl_module.named_parameters()}
            named = {names[p]: s for p, s in opt.state.items()}
        # full_tensor() is a collective: every rank walks the same names in the same order.
        self.state = {
            name: {k: full_tensor(v).detach().float().cpu().clone() for k, v in st.items()}
            for name, st in named.items()
        }  # fmt: skip


def _dequantised(t: torch.Tensor) -> torch.Tensor:
    # torchao's NF4Tensor: its values (its own clone re-quantises with default block sizes)
    return t.get_original_weight() if hasattr(t, "get_original_weight") else t


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        # A unit FSDP2 left gathered (the root, after a forward without backward) registers its gathered values,
        # in the compute dtype (or int8's, under zero_quantized_weights); a state dict switches every unit back to
        # its full-precision shards, which are the weights.
        module.state_dict()
    out = {}
    for name, p in module.named_parameters():
        if (hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")) and p.requires_grad:  # set on every rank
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p).reshape(getattr(p, "ds_shape", p.shape))  # DeepSpeed's fp32 master
        elif hasattr(p, "ds_id"):  # frozen (a LoRA base): no master; the ZeRO-3 partitions gathered
            with _ds_gathered([p]):
                t = p.detach().clone()
        else:
            t = full_tensor(p)
        out[name] = _dequantised(t).detach().float().cpu().clone()
    return out


def _deepspeed_optimizer_state(strategy: Any, opt: Any) -> dict[str, dict[str, Any]]:
    # Each rank keeps a round-robin share of the names (lightning_par.parallel.deepspeed.state): merge them.
    mine = {
        n: {k: v.detach().float().cpu() for k, v in st.items()}
        for n, st in strategy.optimizer_state(opt)["state"].items()
    }
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    return {n: st for share in shares for n, st in share.items()}


def first_attempt() -> bool:
    # torchrun counts restarts of the whole job (--max-restarts); 0 or unset on the first attempt.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def kill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class SigKill(L.Callback):
    """SIGKILLs global rank ``rank`` when global step ``step`` is about to start, on torchrun's first attempt only."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and first_attempt():
            kill_self()


class Corrupt(L.Callback):
    """Global rank ``rank`` adds 1e-3 to the first element of its local copy of parameter ``name`` when global step
    ``step`` starts: one replica drifts, as on failing hardware."""

    def __init__(self, step: int, rank: int, name: str) -> None:
        self.step, self.rank, self.name = step, rank, name

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            param = dict(pl_module.named_parameters())[self.name]
            local = param.to_local() if isinstance(param, DTensor) else param
            with torch.no_grad():
                local.view(-1)[0] += 1e-3


class Hang(L.Callback):
    """Rank ``rank`` makes the job hang at global step ``step`` (tests/jobs.py, ``hang``)."""

    def __init__(self, kind: str, rank: int, step: int) -> None:
        self.kind, self.rank, self.step = kind, rank, step

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.kind != "stall_loader" or trainer.global_rank != self.rank:
            return
        dataset = trainer.train_dataloader.dataset
        base, step = type(dataset), self.step

        def stalling(self_: Any, index: int) -> Any:
            # Lightning fetches a step's batch once the step before it ended (global_step has moved on by then).
            if trainer.global_step == step:
                time.sleep(3600)
            return base.__getitem__(self_, index)

        dataset.__class__ = type("Stalling", (base,), {"__getitem__": stalling})

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.kind == "skip_send":
            from torch.distributed.pipelining import schedules

            post = schedules._batch_p2p

            def without_sends(ops: list[Any], desc: Any = None) -> Any:
                kept = [op for op in ops if op.op is not dist.isend]
                if len(kept) < len(ops):
                    schedules._batch_p2p = post  # once
                return post(kept, desc)

            schedules._batch_p2p = without_sends
        elif self.kind == "skip_all_gather":  # FSDP2's: all_gather_single (torch 2.13) or all_gather_into_tensor
            # Never issued: the rank waits where it would issue it (going on instead would pair its next all-gather
            # with the others' current one, which gloo aborts on as a size mismatch rather than hang).
            def never(*args: Any, **kwargs: Any) -> Any:
                time.sleep(3600)

            for name in ("all_gather_single", "all_gather_into_tensor"):
                if hasattr(dist, name):
                    setattr(dist, name, never)


def _ds_gathered(params: list[Any]) -> Any:
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


class InitRecorder(L.Callback):
    """The full parameters and persistent buffers right after set-up (before any step), merged over pipeline stages."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from lightning_par.checkpoint.strided import full_tensor

        # DeepSpeed ZeRO-3 holds partitions only: gather the whole model for the recording (a test-sized model).
        params = [p for p in pl_module.parameters() if hasattr(p, "ds_id")]
        gathered = _ds_gathered(params) if params else contextlib.nullcontext()
        with gathered:
            state = {k: _dequantised(full_tensor(v)).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        if getattr(getattr(trainer.strategy, "config", None), "pp", 1) > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, state)
            state = {k: v for d in every for k, v in d.items()}
        self.state = state


# The one-process fp8 reference's rule, written here apart from the library's (lightning_par.parallel.fp8): the
# linear layers of the repeated blocks (``h.3``, ``layers.3``), both dimensions multiples of 16.
FP8_BLOCK = re.compile(r"(^|\.)(h|layers|blocks)\.\d+\.")


class TorchaoFp8(L.Callback):
    """The one-process reference of fp8 training: torchao converts the trunk's linear layers (emulated fp8) once
    the model is built and on its device; the parameters stay the same objects, so the optimizer needs nothing.
    ``names``: exactly these layers (the zoo's: what the distributed run converted), instead of the test rule."""

    def __init__(self, names: Optional[list[str]] = None) -> None:
        self.names = None if names is None else set(names)

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def chosen(mod: torch.nn.Module, fqn: str) -> bool:
            if self.names is not None:
                return fqn in self.names
            return bool(FP8_BLOCK.search(fqn)) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

        convert_to_float8_training(pl_module, config=Float8LinearConfig(emulate=True), module_filter_fn=chosen)


def fp8_names(module: torch.nn.Module) -> list[str]:
    """The layers of ``module`` that train in fp8 (torchao's ``Float8Linear``)."""
    return [n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"]
