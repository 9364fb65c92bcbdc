"""Lightning's and torchmetrics' private APIs for `lightning_par._compat` (re-exported there; see its docstring).

Lightning is imported inside each accessor, never at module level: the lower layers import `_compat` and never
Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor


# ---- Lightning ---------------------------------------------------------------------------------------------------
def connector_precision_choice() -> Callable[[Any], Any]:
    """The method with which Lightning's accelerator connector picks the precision plugin (see `set_...`)."""
    # _AcceleratorConnector._check_and_init_precision, lightning 2.6.6: no hook for third-party strategies there.
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return _AcceleratorConnector._check_and_init_precision


def set_connector_precision_choice(method: Callable[[Any], Any]) -> None:
    """Replace the connector's precision choice (`connector_precision_choice`) for every later Trainer."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    _AcceleratorConnector._check_and_init_precision = method  # type: ignore[method-assign, assignment]


def connector_flags(connector: Any) -> tuple[Any, Any, Any]:
    """The Trainer's precision plugin, ``accelerator`` and ``precision`` arguments, as its connector holds them."""
    # _AcceleratorConnector._precision_plugin_flag / _accelerator_flag / _precision_flag, lightning 2.6.6.
    return connector._precision_plugin_flag, connector._accelerator_flag, connector._precision_flag


def stateful_protocol() -> type:
    """Lightning's protocol of objects with ``state_dict`` / ``load_state_dict``: a loader it can resume mid-epoch."""
    # lightning.fabric.utilities.types._Stateful, lightning 2.6.6 (a runtime-checkable Protocol).
    from lightning.fabric.utilities.types import _Stateful

    return _Stateful


def combined_loader(trainer: Any) -> Optional[Any]:
    """The fit loop's `CombinedLoader` over the training loaders, or ``None`` before fit set it up."""
    # _FitLoop._combined_loader, lightning 2.6.6.
    return getattr(trainer.fit_loop, "_combined_loader", None)


def mark_saved_at(callback: Any, step: int) -> None:
    """Tell a `ModelCheckpoint` that the state at ``step`` is saved already (it was just loaded from there)."""
    # ModelCheckpoint._last_global_step_saved, lightning 2.6.6: not restored on resume, so the first batch end after
    # a resume saves again, mid-accumulation, under the loaded checkpoint's own name.
    callback._last_global_step_saved = step


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or ``None`` (``module.trainer`` raises when detached)."""
    # LightningModule._trainer, lightning 2.6.6.
    return getattr(module, "_trainer", None)


def unbind_callback_logging(module: Any) -> None:
    """Undo what the Trainer binds onto its callbacks for ``module``'s run: ``callback.log`` / ``callback.log_dict``.

    Lightning binds them to the module's methods at every run and leaves them, so a callback kept after the run
    would hold the module, its parameters and gradients, and through its trainer the optimizer state, on the device
    (Lightning's own teardown moves the module to the CPU; a sharded module stays). The next run binds them again.
    """
    # CallbackConnector._attach_model_logging_functions, lightning 2.6.6.
    trainer = attached_trainer(module)
    for callback in trainer.callbacks if trainer is not None else ():
        for name in ("log", "log_dict"):
            if getattr(getattr(callback, name, None), "__self__", None) is module:
                delattr(callback, name)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a `LightningOptimizer`, or ``optimizer`` itself."""
    # LightningOptimizer._optimizer, lightning 2.6.6.
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Initialize the default process group from a Lightning cluster environment; ``kwargs`` go to torch."""
    # lightning.fabric.utilities.distributed._init_dist_connection, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_process_group_backend(device: torch.device) -> str:
    """Lightning's process-group backend for ``device`` (``"nccl"`` on CUDA, ``"gloo"`` otherwise)."""
    # lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def distributed_is_initialized() -> bool:
    """Whether torch.distributed is available and its default process group initialized."""
    # lightning.fabric.utilities.distributed._distributed_is_initialized, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    return _distributed_is_initialized()


def sync_ddp_if_available(tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = None) -> Tensor:
    """All-reduce ``tensor`` over ``group`` with Lightning's ``reduce_op`` names (``"mean"``), if distributed."""
    # lightning.fabric.utilities.distributed._sync_ddp_if_available, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def set_subprocess_launcher(strategy: Any) -> None:
    """Give ``strategy`` Lightning's launcher that re-runs the script once per local rank (as DDP's does)."""
    # _SubprocessScriptLauncher and Strategy._launcher, lightning 2.6.6.
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Forget ``strategy``'s optimizers, schedulers and their Lightning wrappers, before it sets them up again."""
    # Strategy._reset_optimizers_and_schedulers, lightning 2.6.6.
    strategy._reset_optimizers_and_schedulers()


def init_deepspeed_distributed(strategy: Any) -> None:
    """Initialize DeepSpeed's process group the way Lightning's `DeepSpeedStrategy` does (benchmarks)."""
    # DeepSpeedStrategy._init_deepspeed_distributed, lightning 2.6.6.
    strategy._init_deepspeed_distributed()


# ---- torchmetrics ------------------------------------------------------------------------------------------------
def metric_state(metric: Any) -> dict[str, Any]:
    """What a `torchmetrics.Metric` has accumulated: its states, update count and last forward value."""
    # Metric._defaults / _update_count / _forward_cache, torchmetrics 1.9.0.
    return {
        "state": {k: getattr(metric, k) for k in metric._defaults},
        "update_count": metric._update_count,
        "forward_cache": metric._forward_cache,
    }


def set_metric_state(metric: Any, data: dict[str, Any]) -> None:
    """Install a `metric_state` into ``metric`` (another rank's), dropping its cached ``compute()`` result."""
    # Metric._update_count / _forward_cache / _computed, torchmetrics 1.9.0.
    for k, v in data["state"].items():
        setattr(metric, k, v)
    metric._update_count = data["update_count"]
    metric._forward_cache = data["forward_cache"]
    metric._computed = None


# ---- Lightning Fabric --------------------------------------------------------------------------------------------
def set_fabric_subprocess_launcher(strategy: Any) -> None:
    """Give a Fabric ``strategy`` Fabric's launcher that re-runs the script once per local rank (as its DDP's does)."""
    # lightning.fabric's _SubprocessScriptLauncher and Strategy._launcher, lightning 2.6.6.
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


def all_gather_ddp_if_available(tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
    """Gather ``tensor`` from every rank of ``group`` into a new leading dimension, if distributed."""
    # lightning.fabric.utilities.distributed._all_gather_ddp_if_available, lightning 2.6.6.
    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

    return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)


def compiled_context(module: Any) -> Optional[dict]:
    """What `lightning.pytorch.utilities.compile.from_compiled` left on a module unwrapped from ``torch.compile``
    (``None`` for a plain one)."""
    # LightningModule._compiler_ctx, lightning 2.6.6: Trainer.fit assigns the unwrapped module to
    # strategy._lightning_module, then refuses it unless the strategy is single-device, DDP or FSDP.
    return getattr(module, "_compiler_ctx", None)


def set_fabric_backward_sync(strategy: Any, control: Any) -> None:
    """Make ``control`` (an object with ``no_backward_sync(module, enabled)``) what ``fabric.no_backward_sync`` asks."""
    # lightning.fabric Strategy._backward_sync_control, lightning 2.6.6: Fabric calls its no_backward_sync.
    strategy._backward_sync_control = control
