"""Sharded checkpoints for `ParallelStrategy`: the Lightning hooks that save, load and remove DCP folders.

A mixin, so that the strategy's own file keeps the layout, process and collective glue; the checkpoint format and
its readers live in `lightning_par.checkpoint`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy as _LightningParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.checkpoint.async_save import AsyncSaver
from lightning_par.checkpoint.dcp import (
    OptimizerEntry,
    load_sharded,
    model_state,
    optimizer_state,
    save_sharded,
    tmp_path,
)
from lightning_par.checkpoint.resume_state import KEY, ResumeState
from lightning_par.parallel.compose import Parallelized
from lightning_par.strategies._pipeline import PipelineSteps


class CheckpointingMixin(_LightningParallelStrategy):
    """Save, load and remove sharded checkpoint folders (`ParallelStrategy` inherits it before Lightning's base).

    Uses the strategy's ``_parallel`` (for the ZeRO engine that owns the optimizer's parameters), ``_async_saver``
    and ``_saving_async`` (see `ParallelStrategy`'s ``async_save``).
    """

    _parallel: Optional[Parallelized]
    _async_saver: Optional[AsyncSaver]
    _saving_async: bool
    _pipeline: Optional[PipelineSteps]
    _resume: Optional[ResumeState] = None
    _async_save_returned = False

    # ---- deterministic resume (checkpoint/resume_state.py) ---------------------------------------------------
    @property
    def _resume_state(self) -> ResumeState:
        if self._resume is None:
            self._resume = ResumeState()
        return self._resume

    @property
    def _attached_trainer(self) -> Any:
        return getattr(self.lightning_module, "_trainer", None)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            self._resume_state.install(dataloader, lambda: trainer.current_epoch)
        return super().process_dataloader(dataloader)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def _optimizer_entries(self) -> list[OptimizerEntry]:
        zero = self._parallel.zero if self._parallel else None
        owner: nn.Module = self.lightning_module  # type: ignore[assignment]
        distribute: Optional[Callable[[str, Any], Any]] = None
        if zero is not None and zero.stage >= 1:
            owner, distribute = zero.masters_module(), zero.distribute_state
        experts = self._parallel.experts if self._parallel else None
        if experts is not None and experts.params:
            distribute = experts.distribute_then(distribute)
        return [
            OptimizerEntry(owner, o._optimizer if isinstance(o, LightningOptimizer) else o, distribute)
            for o in self.optimizers
        ]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state(self.lightning_module, self._distribute_model())  # type: ignore[arg-type]

    def _distribute_model(self) -> Optional[Any]:
        # Expert shards are plain local tensors; as DTensors DCP saves every rank's experts, not rank 0's alone.
        experts = self._parallel.experts if self._parallel else None
        return experts.distribute if experts is not None and experts.params else None

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        for entry in self._optimizer_entries():
            if entry.optimizer is inner:
                state = optimizer_state(entry)
                return self._pipeline.merge_param_groups(state) if self._pipeline is not None else state
        raise ValueError("optimizer_state() got an optimizer the strategy does not manage")

    @property
    def checkpoint_in_flight(self) -> Optional[Path]:
        """The checkpoint being written in the background (``async_save=True``) on this rank, or ``None``."""
        return self._async_saver.in_flight if self._async_saver is not None else None

    def wait_for_staging(self) -> None:
        """Wait until the checkpoint being saved in the background has copied the parameters and optimizer state.

        Runs by itself before every optimizer step; call it only from code that changes parameters in place outside
        ``optimizer.step()`` right after a save (a weight-averaging callback, say).

        Raises:
            CheckpointError: a tensor changed in place before its copy was taken.
        """
        if self._async_saver is not None:
            self._async_saver.wait_for_staging()

    def _staging_fence(self) -> frozenset[int]:
        # Parameters and optimizer state change only in an optimizer step: the save copies them in the background
        # while the next forward and backward run, and a pre-hook on each optimizer's step waits for that copy.
        assert self._async_saver is not None and self.lightning_module is not None
        saver = self._async_saver
        tensors: list[torch.Tensor] = list(self.lightning_module.parameters())
        for entry in self._optimizer_entries():
            if not getattr(entry.optimizer, "_lightning_par_fence", False):
                entry.optimizer.register_step_pre_hook(lambda *_: saver.wait_for_staging())
                entry.optimizer._lightning_par_fence = True  # type: ignore[attr-defined]
            for group in entry.optimizer.param_groups:
                tensors.extend(group["params"])
            for state in entry.optimizer.state.values():
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        local = (t._local_tensor if isinstance(t, DTensor) else t for t in tensors)  # not to_local(): autograd
        return frozenset(t.untyped_storage().data_ptr() for t in local)

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is complete under its name.

        Raises:
            CheckpointError: that save failed.
        """
        if self._async_saver is not None:
            self._async_saver.wait()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._saving_async = self._async_saver is not None
        # Last of the on_train_start hooks, after Lightning set up the training loader: nothing draws random numbers
        # between here and the first resumed step, as in the uninterrupted run between the save and that step.
        self._resume_state.restore_rng(self._attached_trainer, self.root_device)

    @override
    def on_train_end(self) -> None:
        # After every callback's on_train_end; a save in on_fit_end (after this) is synchronous.
        self._saving_async = False
        self.wait_for_checkpoint()
        super().on_train_end()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} saves sharded folders itself; drop storage_options")
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        checkpoint[KEY] = self._resume_state.checkpoint_state(self._attached_trainer, self.world_size)
        local = self._resume_state.rank_state(self._attached_trainer, self.root_device)
        if self._async_saver is not None and self._saving_async:
            deferred = self._staging_fence()
            self._async_saver.save(Path(filepath), tensors, checkpoint, self.global_rank, local, deferred=deferred)
            self._async_save_returned = True  # see `_holds_no_rank`
            return
        self.wait_for_checkpoint()
        path = Path(self.broadcast(str(filepath)))
        save_sharded(path, tensors, checkpoint, self.global_rank, local)

    def _holds_no_rank(self, name: Optional[str]) -> bool:
        # `Trainer.save_checkpoint` ends with a barrier. After an asynchronous save it guards nothing (the write is
        # still going on, and its own collectives run on the saver's group), and it would charge the save with the
        # ranks' step-to-step jitter, which the next gradient reduction absorbs anyway.
        if name == "Trainer.save_checkpoint" and self._async_save_returned:
            self._async_save_returned = False
            return True
        return False

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()  # it may be the one being written
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        elsewhere = self._pipeline.other_stage_keys(self.lightning_module) if self._pipeline else frozenset()
        meta = load_sharded(
            path,
            self.lightning_module,
            self._optimizer_entries(),
            strict=self.lightning_module.strict_loading,
            distribute_model=self._distribute_model(),
            elsewhere=elsewhere,
        )
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resume_state.loaded(path, meta, self.global_rank, self.world_size)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # `load_checkpoint` already loaded the sharded weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # `load_checkpoint` already loaded the sharded optimizer state in place

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if self.checkpoint_in_flight == path:
                self.wait_for_checkpoint()  # rank 0 commits in the writer thread: delete only after the rename
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(tmp_path(path), ignore_errors=True)  # a save of it that was interrupted
