"""Model and optimizer state of a DeepSpeed engine in lightning_par's checkpoint layout, and back.

Our checkpoints (``lightning_par/checkpoint/``) key the model by the original parameter names and the optimizer
like FSDP2's ``get_optimizer_state_dict``: ``{"state": {name: {"exp_avg", "exp_avg_sq", "step"}}, "param_groups":
[{..., "params": [names]}]}``. DeepSpeed keeps the fp32 master weights and the optimizer state in flat partitions
(one per param group and rank) that do not line up with parameters, so we go through DeepSpeed's public
per-parameter helpers (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and the
``safe_set_*`` pair), which work for ZeRO 1-3, bf16, CPU offload and NVMe offload alike (ZeRO-3 swaps the state in
from NVMe itself). Why the full (not the local-shard) variants: a rank's flat partition cuts parameters anywhere,
while our format wants whole tensors or dim-0 shards; each full tensor is built by one all-reduce over the
data-parallel group, one parameter at a time, so at most one full parameter is in flight beyond what is kept.

What is kept: each parameter's tensors are kept by one rank only (round robin over names), so a rank holds about
1/world of the checkpoint, and DCP writes each tensor once. Loading reads full tensors on every rank (about 3x the
fp32 weights of memory for Adam, briefly) and each rank keeps only its partition through ``safe_set_*``.

Two things the helpers do not do, done here: Adam's state exists only after the first step, so before a load the
optimizer takes one step with zero gradients at learning rate 0 (torch's own ``_init_optim_state`` trick, on
DeepSpeed's fp32 partitions), and the ``step`` counter lives once per flat partition, so it is read and written
there. The low-precision copies the forward uses are refreshed from the loaded fp32 weights (a gather-modify-
scatter under ZeRO-3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par import _compat


@dataclasses.dataclass
class EngineParts:
    """Where a DeepSpeed engine keeps what we read and write.

    Args:
        inner: the torch (or DeepSpeedCPUAdam) optimizer that steps on the fp32 partitions.
        flats: the tensors it steps on: one flat fp32 partition per (sub)group under ZeRO / bf16, or the module's
            own parameters under plain fp32 ZeRO-0.
        wrapper: DeepSpeed's ZeRO / bf16 optimizer around ``inner`` (``None`` under plain fp32 ZeRO-0).
    """

    inner: torch.optim.Optimizer
    flats: list[torch.Tensor]
    wrapper: Optional[Any]


def engine_parts(engine: Any) -> EngineParts:
    """Find the inner optimizer and its fp32 partitions for ZeRO 1/2, ZeRO-3, bf16 ZeRO-0 and fp32 ZeRO-0."""
    opt = engine.optimizer
    flats = _compat.zero_fp32_partitions(opt)
    if flats is not None:
        return EngineParts(opt.optimizer, list(flats), opt)
    return EngineParts(opt, [p for g in opt.param_groups for p in g["params"]], None)


def _swapped(parts: EngineParts) -> bool:
    # ZeRO-3 with the optimizer state on NVMe: the partitions are swapped in and out by DeepSpeed.
    return _compat.zero_swaps_optimizer(parts.wrapper)


def _full_fp32(param: nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)  # None under plain fp32 ZeRO-0: the parameter is the master
    return param.detach().float() if value is None else value


def param_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's full shape (under ZeRO-3 the parameter itself is an empty placeholder)."""
    return _compat.zero3_shape(param)  # ZeRO-3 params are empty placeholders


def state_keys(parts: EngineParts) -> list[str]:
    """The optimizer's per-element state keys (``exp_avg``, ``exp_avg_sq`` for Adam), ``step`` excluded."""
    for flat in parts.flats:
        state = parts.inner.state.get(flat)
        if state:
            return sorted(k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0)
    return []


def step_count(parts: EngineParts) -> int:
    """Adam's step counter (the same for every partition; DeepSpeed keeps one per flat partition)."""
    steps = [parts.inner.state[f]["step"] for f in parts.flats if "step" in parts.inner.state.get(f, {})]
    return int(max((float(s) for s in steps), default=0))


def materialize_optimizer_state(parts: EngineParts) -> None:
    """Create the optimizer state before the first step, so it can be overwritten by a checkpoint.

    One step with zero gradients at learning rate 0 (torch AdamW: ``p *= 1 - 0 * wd``, ``p -= 0 * m / v``: the
    weights do not move), then the step counters are reset to 0, which is the state of a fresh optimizer.
    """
    if _swapped(parts):
        raise NotImplementedError(
            "loading a checkpoint into DeepSpeed with the optimizer state on NVMe (deepspeed_zero3_nvme) is not "
            "supported yet: resume with deepspeed_zero3_offload or deepspeed_zero3, then switch"
        )
    if all(parts.inner.state.get(f) for f in parts.flats):
        link_optimizer_state(parts)
        return
    # DeepSpeed steps one partition at a time with only its param group installed (ZeRO-3 even keeps the groups
    # empty between steps), so do the same: the other groups' partitions may hold gradient buffers (offload).
    groups = parts.inner.param_groups
    to_group = _compat.zero_sub_group_to_group_id(parts.wrapper)
    for i, flat in enumerate(parts.flats):
        if parts.inner.state.get(flat):
            continue
        group = groups[to_group[i] if to_group is not None else i] if parts.wrapper is not None else None
        if group is None:  # plain fp32 ZeRO-0: the client optimizer over the module's own parameters
            group = next(g for g in groups if any(p is flat for p in g["params"]))
        saved = (group["params"], group["lr"], flat.grad)
        group.update(params=[flat], lr=0.0)
        flat.grad = torch.zeros_like(flat)
        parts.inner.param_groups = [group]
        try:
            parts.inner.step()
        finally:
            parts.inner.param_groups = groups
            group["params"], group["lr"], flat.grad = saved
    set_step_count(parts, 0)
    link_optimizer_state(parts)


def link_optimizer_state(parts: EngineParts) -> None:
    """(Re)link each parameter to its slice of the optimizer state, which the ``safe_*_optimizer_state`` helpers read.

    ZeRO 1/2 and bf16 make that link once, right after the first step of the first param group, when the other
    groups have no state yet (DeepSpeed 0.19): with two groups (decayed / not decayed, as most models have) the
    second group's link stays empty. Linking again once every group has state fixes it; it only makes views.
    """
    _compat.zero_relink_optimizer_state(parts.wrapper)


def set_step_count(parts: EngineParts, step: int) -> None:
    """Set every partition's step counter, keeping its type (a tensor for torch, an int for DeepSpeedCPUAdam)."""
    for flat in parts.flats:
        state = parts.inner.state.get(flat)
        if state is None or "step" not in state:
            continue
        old = state["step"]
        state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device) if torch.is_tensor(old) else step


def gather_model(engine: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full fp32 weights (and persistent buffers), for the names this rank keeps.

    Collective: every rank of the data-parallel group must call it. Each parameter is kept by one rank (round
    robin over names), buffers by rank 0.

    Args:
        engine: the DeepSpeed engine.
        module: the module the engine wraps (its parameter names are the keys).
    """
    del engine  # the parameters carry their own link to DeepSpeed's partitions
    rank, world = dist.get_rank(), dist.get_world_size()
    model: dict[str, torch.Tensor] = {}
    for i, (name, param) in enumerate(module.named_parameters()):
        full = _full_fp32(param)
        if i % world == rank:
            model[name] = full.reshape(param_shape(param)).detach().clone()
    if rank == 0:
        for name, buf in module.named_buffers():
            if is_persistent(module, name):
                model[name] = buf.detach().clone()
    return model


def gather_optimizer(
    engine: Any, module: nn.Module, group_names: Sequence[Sequence[str]], group_options: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The optimizer state in our layout (FSDP2's ``get_optimizer_state_dict`` keys), for the names this rank keeps.

    Collective, like `gather_model`.

    Args:
        engine: the DeepSpeed engine.
        module: the module the engine wraps.
        group_names: the parameter names of each param group, in the client optimizer's order.
        group_options: each group's hyper-parameters as the client optimizer holds them (``params`` left out).

    Returns:
        ``{"state": {name: {key: tensor, "step": tensor}}, "param_groups": [{..., "params": [names]}]}``.
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    rank, world = dist.get_rank(), dist.get_world_size()
    parts = engine_parts(engine)
    if not all(parts.inner.state.get(f) for f in parts.flats):
        materialize_optimizer_state(parts)  # a save before the first step: the fresh state, explicitly
    link_optimizer_state(parts)
    keys = state_keys(parts)
    step = torch.tensor(float(step_count(parts)))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, param) in enumerate(module.named_parameters()):
        if not param.requires_grad:
            continue
        keep = i % world == rank
        entry: dict[str, torch.Tensor] = {}
        for key in keys:
            value = safe_get_full_optimizer_state(param, key)
            if value is None:  # plain fp32 ZeRO-0: the optimizer steps on the parameter itself
                value = parts.inner.state[param][key]
            if keep:
                entry[key] = value.reshape(param_shape(param)).detach().float().clone()
        if keep:
            state[name] = {**entry, "step": step.clone()}
    groups = [{**opts, "params": list(names)} for opts, names in zip(group_options, group_names)]
    return {"state": state, "param_groups": groups}


def is_persistent(module: nn.Module, name: str) -> bool:
    """Whether the buffer ``name`` of ``module`` is saved in its state dict."""
    owner_name, _, buf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return buf not in _compat.non_persistent_buffers(owner)


def scatter_state(
    engine: Any,
    module: nn.Module,
    model: dict[str, torch.Tensor],
    optimizer: Optional[dict[str, Any]],
) -> None:
    """Load full fp32 weights and name-keyed optimizer state (our checkpoint layout) into a DeepSpeed engine.

    Collective (ZeRO-3 gathers each parameter to refresh its low-precision shards).

    Args:
        engine: the DeepSpeed engine.
        module: the module the engine wraps.
        model: name -> full tensor, for every parameter (and persistent buffer).
        optimizer: ``{"state": {name: {...}}, ...}`` or ``None`` for weights only.
    """
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    parts = engine_parts(engine)
    if optimizer is not None:
        materialize_optimizer_state(parts)
        steps = {float(st["step"]) for st in optimizer["state"].values() if "step" in st}
        if len(steps) > 1:
            raise ValueError(
                f"the checkpoint's parameters are at different optimizer steps {sorted(steps)}; DeepSpeed keeps one "
                "step per parameter group, so it cannot resume this state"
            )
        set_step_count(parts, int(steps.pop()) if steps else 0)
    zero3 = _compat.is_zero3(parts.wrapper)
    for name, param in module.named_parameters():
        value = model[name].float()
        if parts.wrapper is None:
            param.data.copy_(value)
        else:
            safe_set_full_fp32_param(param, value)
            if zero3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if dist.get_rank() == 0:
                        param.data.copy_(value.to(param.dtype))
            else:
                param.data.copy_(value.to(param.dtype))
        if optimizer is None or not param.requires_grad:
            continue
        for key, v in optimizer["state"][name].items():
            if key == "step":
                continue
            if parts.wrapper is None:
                parts.inner.state[param][key].copy_(v)
            else:
                safe_set_full_optimizer_state(param, v.float(), key)
    for name, buf in module.named_buffers():
        if name in model:
            buf.data.copy_(model[name])
