"""ZeRO through DeepSpeed: the DeepSpeed config generated from a `ParallelConfig`, and the engine built from it.

Pure torch + DeepSpeed (no Lightning). `lightning_par.strategies.deepspeed` glues it to the trainer; the native
ZeRO of `compose.py` and this backend are interchangeable: same names, same checkpoint format
(`lightning_par.parallel.deepspeed.state`).

What we generate and why (keys of the DeepSpeed JSON, https://www.deepspeed.ai/docs/config-json/):

- ``zero_optimization.stage`` from ``zero_stage``; under ``offload`` both the optimizer state and the ZeRO-3
  parameter shards go to ``"cpu"`` (native ``zero3_offload`` keeps both in CPU memory too) or to ``"nvme"`` (files
  in ``nvme_path``, read and written with DeepSpeed's async I/O op, which needs libaio).
- ``bf16.enabled`` for ``bf16-mixed`` / ``bf16-true``: DeepSpeed keeps bf16 parameters for compute and fp32 master
  weights and optimizer state in its optimizer, for both flags. ``16-mixed`` maps to ``fp16`` with DeepSpeed's
  dynamic loss scaling where the accelerator supports fp16 (DeepSpeed's CPU accelerator refuses it).
- ``gradient_accumulation_steps`` from the trainer; the trainer already divides the loss by it, so the engine's
  backward is called with ``scale_wrt_gas=False`` and the boundary is set explicitly.
- ``gradient_clipping`` from ``Trainer(gradient_clip_val=...)``: DeepSpeed clips on the global norm over all
  shards, as our native clipping does.
- ``train_micro_batch_size_per_gpu`` = 1 at construction, before the loader exists; the strategy sets the real
  per-rank batch from the first training batch (``engine.set_train_micro_batch_size``). Bookkeeping only (DeepSpeed's
  throughput log and ``train_batch_size``): the trainer feeds the batches.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_par.config import ParallelConfig, ParallelConfigError

OffloadDevice = Optional[str]  # None, "cpu" or "nvme"

# Keys whose value follows from the strategy or the Trainer. A user DeepSpeed JSON that sets one of them to another
# value conflicts with the run's own settings (two sources for one fact): it is reported, never silently chosen.
_DERIVED = (
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "bf16.enabled",
    "fp16.enabled",
    "gradient_accumulation_steps",
    "gradient_clipping",
)
_FIX = {
    "zero_optimization.stage": "pick the strategy name with that stage (deepspeed_zero1/2/3)",
    "zero_optimization.offload_optimizer.device": "use deepspeed_zero3_offload / deepspeed_zero3_nvme",
    "zero_optimization.offload_param.device": "use deepspeed_zero3_offload / deepspeed_zero3_nvme",
    "bf16.enabled": "set Trainer(precision=...)",
    "fp16.enabled": "set Trainer(precision=...)",
    "gradient_accumulation_steps": "set Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "set Trainer(gradient_clip_val=...)",
}


class DeepSpeedConfigError(ParallelConfigError):
    """A DeepSpeed setting that cannot run, or that contradicts the strategy / Trainer; the message names the fix."""


def check_deepspeed_layout(config: ParallelConfig) -> None:
    """Reject, before any process exists, what the DeepSpeed backend cannot do with our other dimensions.

    Args:
        config: the strategy's (unresolved) configuration.

    Raises:
        DeepSpeedConfigError: naming the dimension, the reason and the fix.
    """
    reasons = {
        "tp": "DeepSpeed's ZeRO shards a module it owns; our tensor parallelism turns parameters into DTensors, "
        "which DeepSpeed's flat fp32 partitions cannot hold",
        "pp": "our pipeline schedules (torch.distributed.pipelining) own backward and the step, which DeepSpeed's "
        "engine also owns; DeepSpeed's own PipelineModule needs a model rewritten as a layer list",
        "ep": "DeepSpeed ZeRO would shard our expert parameters over all data-parallel ranks, against the expert "
        "grouping (and DeepSpeed's own MoE refuses ZeRO-3)",
        "cp": "DeepSpeed's engine would average gradients over the data-parallel ranks only, while every "
        "context-parallel rank holds a part of each gradient",
    }
    for axis, why in reasons.items():
        if getattr(config, axis) > 1:
            raise DeepSpeedConfigError(
                f"{axis}={getattr(config, axis)} cannot be combined with the DeepSpeed backend: {why}; use "
                f"backend='native' for {axis} > 1, or set {axis}=1"
            )
    if config.compile:
        raise DeepSpeedConfigError(
            "compile=True cannot be combined with the DeepSpeed backend: DeepSpeed's ZeRO hooks on every submodule "
            "would sit inside each compiled block; use backend='native' (ParallelStrategy(zero_stage=..., "
            "compile=True) or strategy='zero2' / 'zero3' with compile=True), or compile=False"
        )
    if config.dp_replicate > 1:
        raise DeepSpeedConfigError(
            f"dp_replicate={config.dp_replicate} (hybrid sharding) is not mapped to DeepSpeed (its ZeRO++ hpZ "
            "shards parameters only, not the optimizer state, so it is not the same layout); use backend='native' "
            "or dp_replicate=1"
        )
    if config.activation_checkpointing is not None:
        raise DeepSpeedConfigError(
            f"activation_checkpointing={config.activation_checkpointing!r} is not wired to the DeepSpeed backend; use "
            "backend='native' or activation_checkpointing=None"
        )


def build_config(
    config: ParallelConfig,
    *,
    precision: str,
    accumulate: int = 1,
    clip_val: Optional[float] = None,
    offload_device: OffloadDevice = None,
    nvme_path: Optional[Union[str, Path]] = None,
) -> dict[str, Any]:
    """The DeepSpeed config for a resolved layout and a ``Trainer(precision=...)`` flag.

    Args:
        config: the resolved configuration (zero_stage, offload).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        accumulate: ``Trainer(accumulate_grad_batches=...)``.
        clip_val: ``Trainer(gradient_clip_val=...)`` (norm clipping), or ``None``.
        offload_device: where offloaded state lives when ``config.offload``: ``"cpu"`` (default) or ``"nvme"``.
        nvme_path: the folder for ``"nvme"`` offload (one per node; DeepSpeed adds a sub-folder per rank).
    """
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.offload:
        device = offload_device or "cpu"
        if device not in ("cpu", "nvme"):
            raise DeepSpeedConfigError(f"offload_device={device!r} is unknown; choose 'cpu' or 'nvme'")
        # pin_memory needs an accelerator (docs/testing.md); on GPUs pinned buffers speed up the copies.
        pin = torch.cuda.is_available()
        target: dict[str, Any] = {"device": device, "pin_memory": pin}
        if device == "nvme":
            if nvme_path is None:
                raise DeepSpeedConfigError("offload_device='nvme' needs nvme_path= (a local folder on a fast disk)")
            target["nvme_path"] = str(nvme_path)
        zero["offload_optimizer"] = dict(target)
        zero["offload_param"] = dict(target)
    elif offload_device is not None:
        raise DeepSpeedConfigError(f"offload_device={offload_device!r} needs offload=True (zero_stage=3)")
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulate,
        "gradient_clipping": float(clip_val or 0.0),
        "zero_optimization": zero,
        # The client optimizer (torch AdamW, SGD, ...) is the one that steps on DeepSpeed's fp32 partitions.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if precision in ("bf16-mixed", "bf16-true"):
        ds["bf16"] = {"enabled": True}
    elif precision == "16-mixed":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}  # 0: dynamic loss scaling
    elif precision != "32-true":
        raise DeepSpeedConfigError(
            f"precision={precision!r} has no DeepSpeed mapping; choose '32-true', 'bf16-mixed', 'bf16-true' or "
            "'16-mixed'"
        )
    if config.offload and (offload_device or "cpu") == "nvme":
        # Small blocks and queues: NVMe offload also runs on a laptop disk (DeepSpeed's defaults assume NVMe RAID).
        ds["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return ds


def load_user_config(user: Union[str, Path, Mapping[str, Any], None]) -> dict[str, Any]:
    """A user DeepSpeed config given as a dict or a JSON file path (``None``: empty)."""
    if user is None:
        return {}
    if isinstance(user, Mapping):
        return copy.deepcopy(dict(user))
    path = Path(user)
    if not path.is_file():
        raise DeepSpeedConfigError(f"deepspeed_config={str(user)!r} is not a file; pass a JSON file path or a dict")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"deepspeed_config {path} is not valid JSON: {err}") from err
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"deepspeed_config {path} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_user_config(ours: dict[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay a user DeepSpeed config on the generated one.

    Every key the user sets wins (bucket sizes, overlap, aio, nvme_path, micro batch size, ...), except keys that
    follow from the strategy or the Trainer (stage, offload device, precision, accumulation, clipping): a different
    value there is a conflict, reported with both values and where to change them. An ``optimizer`` or
    ``scheduler`` section is refused: the LightningModule's ``configure_optimizers`` owns both.

    Raises:
        DeepSpeedConfigError: listing every conflict.
    """
    problems = []
    for key in ("optimizer", "scheduler"):
        if key in user:
            problems.append(
                f"{key}: the DeepSpeed JSON defines one, but configure_optimizers() owns the {key} under "
                f"lightning_par; drop the JSON's '{key}' section"
            )
    for key in _DERIVED:
        theirs, mine = _get(user, key), _get(ours, key)
        if theirs is None:
            continue
        if key.endswith(".enabled") and mine is None:
            mine = False
        if key.endswith(".device") and mine is None:
            mine = "none"
        if key == "gradient_clipping":
            theirs, mine = float(theirs), float(mine)
        if theirs != mine:
            problems.append(
                f"{key}: the strategy/Trainer give {mine!r}, the DeepSpeed JSON gives {theirs!r}; {_FIX[key]}"
            )
    if problems:
        raise DeepSpeedConfigError("the DeepSpeed JSON conflicts with this run's settings:\n  " + "\n  ".join(problems))
    return _merge(ours, user)


def deepspeed_optimizer(optimizer: torch.optim.Optimizer, offloaded: bool) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed should step: the client's own, or DeepSpeedCPUAdam with the same groups under offload.

    DeepSpeed's ZeRO-Offload steps the fp32 partitions on the CPU with its vectorized C++ Adam and, by default,
    refuses a torch optimizer there. torch Adam / AdamW map exactly onto it (``adamw_mode`` = decoupled weight
    decay, same lr, betas, eps, weight decay per group; bias correction as torch). Other optimizers keep running
    as torch code on the CPU partitions (``zero_force_ds_cpu_optimizer`` is then turned off by the caller).

    Args:
        optimizer: what ``configure_optimizers`` returned, over the module's parameters.
        offloaded: whether the optimizer state is offloaded (ZeRO-Offload).
    """
    if not offloaded or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    for group in optimizer.param_groups:
        unsupported = [k for k in ("amsgrad", "maximize") if group.get(k)]
        if unsupported or isinstance(group["lr"], torch.Tensor):
            raise DeepSpeedConfigError(
                f"{type(optimizer).__name__} with {unsupported or 'a tensor lr'} has no DeepSpeedCPUAdam equivalent "
                "under offload; drop it or use a strategy without offload"
            )
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [
        {"params": g["params"], "lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"],
         "weight_decay": g["weight_decay"]}
        for g in optimizer.param_groups
    ]  # fmt: skip
    return DeepSpeedCPUAdam(groups, adamw_mode=isinstance(optimizer, torch.optim.AdamW))


def use_cpu_accelerator() -> None:
    """Make DeepSpeed use its CPU accelerator (gloo) when the trainer runs on CPU, even on a machine with GPUs."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def fp16_supported() -> bool:
    """Whether DeepSpeed's current accelerator can train in fp16 (its CPU accelerator on most CPUs cannot)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload's reads and writes) can be built or loaded here.

    It needs libaio and its headers; DeepSpeed's own probe compiles a test program against them (~3 s).
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and bool(builder.is_compatible(verbose=False))


def check_async_io(available: bool) -> None:
    """Refuse NVMe offload before training when its op cannot be built (else DeepSpeed fails deep inside, with
    "Unable to JIT load the async_io op")."""
    if not available:
        raise DeepSpeedConfigError(
            "deepspeed_zero3_nvme (offload_device='nvme') needs DeepSpeed's async_io op, which cannot be built here: "
            "it needs the libaio library and its headers. Install them (Debian/Ubuntu: apt-get install libaio-dev; "
            "RHEL/Fedora: dnf install libaio-devel), or offload to CPU memory instead: deepspeed_zero3_offload"
        )


def init_comm() -> None:
    """Point DeepSpeed's comm layer at the (gloo or nccl) default process group that already exists."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)


def initialize_engine(
    module: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    ds_config: dict[str, Any],
) -> Any:
    """``deepspeed.initialize`` over an existing (gloo or nccl) default process group.

    Args:
        module: the model; DeepSpeed shards and casts it in place (ZeRO-3 partitions its parameters).
        optimizer: the optimizer to step (see `deepspeed_optimizer`), or ``None`` for evaluation only.
        ds_config: the config from `build_config` / `merge_user_config`.

    Returns:
        the ``DeepSpeedEngine``.
    """
    import deepspeed

    init_comm()
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config, dist_init_required=False)
    return engine
