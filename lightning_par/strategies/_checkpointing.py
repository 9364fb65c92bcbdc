"""Sharded checkpoint folders for `ParallelStrategy`: save (synchronous or in the background), load, remove, and the
deterministic-resume state, as one component the strategy's Lightning hooks delegate to.

It holds only its own state (the background saver, the resume state, whether saves are asynchronous now) and is
handed what it needs on each call; the checkpoint format and its readers live in `lightning_par.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import nn

from lightning_par import _compat
from lightning_par.checkpoint.adapters import ADAPTERS, FROZEN_LEFT_OUT, adapter_configs, frozen_names
from lightning_par.checkpoint.async_save import AsyncSaver
from lightning_par.checkpoint.dcp import (
    FRESH,
    LOCAL_SGD,
    OptimizerEntry,
    load_sharded,
    optimizer_state,
    save_sharded,
    tmp_path,
)
from lightning_par.checkpoint.pretrained.peft_in import base_source
from lightning_par.checkpoint.reader import CheckpointError, read_meta
from lightning_par.checkpoint.resume_state import KEY
from lightning_par.parallel.compression.powersgd import POWERSGD
from lightning_par.parallel.compression.powersgd import restore as restore_compression
from lightning_par.parallel.local_sgd import state as local_sgd_state
from lightning_par.parallel.pipeline.two_bw import TWO_BW, TwoBW
from lightning_par.parallel.pipeline.two_bw import restore as restore_two_bw
from lightning_par.parallel.run import ParallelRun
from lightning_par.strategies._resume import ResumeState
from lightning_par.utils import dtensors


@dataclasses.dataclass(frozen=True)
class Where:
    """Who is saving or loading: what a checkpoint call needs from the strategy.

    Args:
        trainer: the trainer (``None`` outside one).
        rank: this process's global rank; ``world_size``: the number of processes.
        device: this rank's device (RNG states).
        broadcast: rank 0's object to every rank (checkpoint paths must agree).
    """

    trainer: Any
    rank: int
    world_size: int
    device: torch.device
    broadcast: Callable[[Any], Any]


def optimizer_entries(run: Optional[ParallelRun], module: nn.Module, optimizers: Sequence[Any]) -> list[OptimizerEntry]:
    """Each optimizer with the module whose names key its state and the wrapping of sharded state for DCP."""
    owner, distribute = run.optimizer_owner() if run is not None else (module, None)
    return [OptimizerEntry(owner, _inner(o), distribute) for o in optimizers]


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return _compat.unwrap_optimizer(optimizer)


class ShardedCheckpoints:
    """The strategy's checkpoint folders.

    Args:
        timeout: collective timeout of the background saver's process group.
        async_save: checkpoints saved during ``fit`` are written in the background (see `ParallelStrategy`).
    """

    def __init__(self, timeout: timedelta, async_save: bool, frozen: bool = True, pretrained: Any = None) -> None:
        self.saver = AsyncSaver(timeout) if async_save else None
        self.frozen = frozen  # False: the frozen parameters are left out of checkpoints (`checkpoint_frozen`)
        # Where they come from again on resume: the base of `pretrained=` (its resolved path), recorded and checked.
        base = base_source(pretrained)
        self.pretrained = str(Path(base).resolve()) if base else None
        self.resume = ResumeState()
        self.saving_async = False  # between on_train_start and on_train_end: other saves are synchronous
        self._async_save_returned = False

    # ---- the fit's edges ---------------------------------------------------------------------------------------
    def on_train_loader(self, trainer: Any, dataloader: object) -> None:
        """Make a training loader resumable (its position is saved and restored)."""
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            self.resume.install(dataloader, lambda: trainer.current_epoch)

    def on_train_start(self, trainer: Any, device: torch.device) -> None:
        """Saves are asynchronous from here on; the loaded RNG states are restored."""
        self.saving_async = self.saver is not None
        # Last of the on_train_start hooks, after Lightning set up the training loader: nothing draws random numbers
        # between here and the first resumed step, as in the uninterrupted run between the save and that step.
        self.resume.restore_rng(trainer, device)
        if trainer.global_step > 0:  # resumed: the loaded step is saved (else the first micro-batch saves again)
            for callback in trainer.checkpoint_callbacks:
                _compat.mark_saved_at(callback, trainer.global_step)

    def on_train_end(self) -> None:
        """Saves are synchronous again (after every callback's on_train_end; one in on_fit_end waits)."""
        self.saving_async = False
        self.wait()

    # ---- save ----------------------------------------------------------------------------------------------------
    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: Path,
        where: Where,
        module: nn.Module,
        entries: list[OptimizerEntry],
        run: Optional[ParallelRun],
    ) -> None:
        """Write Lightning's ``checkpoint`` dict (its tensors already name-keyed and sharded) as a folder."""
        tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        if not self.frozen:  # the frozen weights come back from where they came from (`pretrained=`) on resume
            left_out = frozen_names(module)
            tensors["state_dict"] = {k: v for k, v in tensors["state_dict"].items() if k not in left_out}
            checkpoint[FROZEN_LEFT_OUT] = {"count": len(left_out), "pretrained": self.pretrained}
        if adapters := adapter_configs(module):  # for `lightning-par consolidate --format peft`
            checkpoint[ADAPTERS] = adapters
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        checkpoint[KEY] = self.resume.checkpoint_state(where.trainer, where.world_size)
        zero = run.zero if run is not None and local_sgd_state.active(run.zero) else None
        if zero is not None:  # the replicas' own state under keys of their own (parallel.local_sgd.state)
            tensors = local_sgd_state.save_layout(zero, tensors)
            checkpoint[KEY][LOCAL_SGD] = local_sgd_state.describe(zero)
        local = self.resume.rank_state(where.trainer, where.device)
        compression = getattr(run.zero, "compression", None) if run is not None else None
        if compression is not None:  # PowerSGD's error and factors differ per rank: in the rank's own file
            local[POWERSGD] = compression.state_dict()
        local[FRESH_KEY] = [i for i, entry in enumerate(entries) if entry.optimizer in FRESH]  # dcp.optimizer_state
        if (two_bw := _two_bw(run)) is not None:  # the stream's pending gradient (each stage's own)
            local[TWO_BW] = two_bw.state_dict({id(p): n for n, p in module.named_parameters()})
        if self.saver is not None and self.saving_async:
            deferred = self._staging_fence(module, entries)
            self.saver.save(filepath, tensors, checkpoint, where.rank, local, deferred=deferred)
            self._async_save_returned = True  # see `holds_no_rank`
            return
        self.wait()
        save_sharded(Path(where.broadcast(str(filepath))), tensors, checkpoint, where.rank, local)

    def _staging_fence(self, module: nn.Module, entries: list[OptimizerEntry]) -> frozenset[int]:
        # Parameters and optimizer state change only in an optimizer step: the save copies them in the background
        # while the next forward and backward run, and a pre-hook on each optimizer's step waits for that copy.
        assert self.saver is not None
        saver = self.saver
        tensors: list[torch.Tensor] = list(module.parameters())
        for entry in entries:
            if not getattr(entry.optimizer, "_lightning_par_fence", False):
                entry.optimizer.register_step_pre_hook(lambda *_: saver.wait_for_staging())
                entry.optimizer._lightning_par_fence = True  # type: ignore[attr-defined]
            for group in entry.optimizer.param_groups:
                tensors.extend(group["params"])
            for state in entry.optimizer.state.values():
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        # (the plain tensors behind each: a DTensor's shard, the values an fp8 weight wraps)
        return frozenset(part.untyped_storage().data_ptr() for t in tensors for part in dtensors.storages(t))

    def holds_no_rank(self, barrier_name: Optional[str]) -> bool:
        """Whether a barrier can be skipped: the one ending `Trainer.save_checkpoint` right after a background save.

        It guards nothing then (the write is still going on, its collectives run on the saver's group), and it would
        charge the save with the ranks' step-to-step jitter, which the next gradient reduction absorbs anyway.
        """
        if barrier_name == "Trainer.save_checkpoint" and self._async_save_returned:
            self._async_save_returned = False
            return True
        return False

    @staticmethod
    def optimizer_state(run: Optional[ParallelRun], entries: list[OptimizerEntry], optimizer: Any) -> dict[str, Any]:
        """One optimizer's name-keyed state (sharded tensors as DTensors), merged over the pipeline's stages."""
        inner = _inner(optimizer)
        for entry in entries:
            if entry.optimizer is inner:
                state = optimizer_state(entry)
                return run.merge_param_groups(state) if run is not None else state
        raise ValueError("optimizer_state() got an optimizer the strategy does not manage")

    # ---- load and remove ---------------------------------------------------------------------------------------
    def load(
        self, path: Path, where: Where, module: Any, entries: list[OptimizerEntry], run: Optional[ParallelRun]
    ) -> dict[str, Any]:
        """Load a folder into the sharded module and optimizers in place; return the rest of Lightning's dict."""
        self.wait()  # it may be the one being written
        path = Path(where.broadcast(str(path)))
        local_sgd = local_sgd_state.LoadLayout(run.zero if run is not None else None)
        # A checkpoint saved with checkpoint_frozen=False holds no frozen weight: they stay as set up (pretrained=).
        left_out = read_meta(path).get(FROZEN_LEFT_OUT)
        frozen = frozen_names(module) if left_out else frozenset()
        if left_out and left_out.get("pretrained") != self.pretrained:
            raise CheckpointError(
                f"{path} holds the trained weights only; its frozen ones came from the base "
                f"{left_out['pretrained']!r} and this run's from {self.pretrained!r}, so it would resume on other "
                "weights: pass that base as pretrained= (or resume from a checkpoint saved with checkpoint_frozen=True)"
            )
        meta = load_sharded(
            path,
            module,
            entries,
            strict=module.strict_loading,
            distribute_model=run.distribute_model() if run is not None else None,
            elsewhere=(run.other_stage_keys() if run is not None else frozenset()) | local_sgd.elsewhere(module),
            keep=frozen,
            layout=local_sgd,
        )
        local_sgd.finish()
        if where.trainer is not None and where.trainer.state.fn == TrainerFn.FITTING:
            self.resume.loaded(path, meta, where.rank, where.world_size)
            if run is not None and run.zero is not None:
                restore_compression(run.zero, self.resume.own(POWERSGD), path)
            restore_two_bw(_two_bw(run), self.resume.own(TWO_BW), path, module)
            for i in self.resume.own(FRESH_KEY) or ():  # saved before its first step: no state, as then
                entries[i].optimizer.state.clear()
        return meta

    def remove(self, filepath: Path, is_global_zero: bool) -> None:
        """Delete a checkpoint folder (and an interrupted save of it), once its background write is committed."""
        if is_global_zero:
            if self.in_flight == filepath:
                self.wait()  # rank 0 commits in the writer thread: delete only after the rename
            shutil.rmtree(filepath, ignore_errors=True)
            shutil.rmtree(tmp_path(filepath), ignore_errors=True)

    # ---- the background write ------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> Optional[Path]:
        """The checkpoint being written in the background on this rank, or ``None``."""
        return self.saver.in_flight if self.saver is not None else None

    def wait_for_staging(self) -> None:
        """Wait until the save in flight has copied the parameters and optimizer state (see `ParallelStrategy`)."""
        if self.saver is not None:
            self.saver.wait_for_staging()

    def wait(self) -> None:
        """Wait until the save in flight, if any, is complete under its name."""
        if self.saver is not None:
            self.saver.wait()

    def release(self) -> None:
        """Wait for the last save, then free the staging buffers (teardown)."""
        self.saving_async = False
        if self.saver is not None:
            self.saver.release()


FRESH_KEY = "fresh_optimizers"  # a rank's optimizers saved before their first step (`dcp.optimizer_state`)


def _two_bw(run: Optional[ParallelRun]) -> Optional[TwoBW]:
    """The PipeDream-2BW runtime of ``run``'s pipeline, if it has one."""
    pipeline = run.pipeline if run is not None else None
    return pipeline.two_bw if pipeline is not None else None
