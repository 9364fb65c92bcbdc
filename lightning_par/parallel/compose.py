"""The one function that fixes the order in which parallel techniques are applied, and says why."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.parallel.tensor_parallel import TensorParallelInfo, apply_tensor_parallel
from lightning_par.parallel.zero import apply_fsdp, sync_module_states
from lightning_par.parallel.zero_replicated import ReplicatedZero
from lightning_par.plans.tp import infer_tp_plan, validate_tp
from lightning_par.plans.trunk import find_trunk


class StepRoot(nn.Module):
    """A root module around the user's module whose forward the trainer redirects to ``training_step``.

    FSDP2 gathers the root's own parameters and finalises gradient reduction from hooks on the root's
    ``__call__``. Lightning calls ``training_step`` (not ``forward``), so without this root those hooks would not
    fire. The user's module keeps its parameter names: it is ``self.module`` here and checkpoints use it directly.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclasses.dataclass
class Parallelized:
    """What `parallelize` built.

    Args:
        model: the module the trainer calls (the user's module, or a `StepRoot` around it).
        zero: the ZeRO 0-2 engine that reduces gradients and shards the optimizer, or ``None`` under ZeRO-3.
        checkpointed_blocks: indices of the trunk blocks under activation checkpointing.
        tensor_parallel: what tensor parallelism changed, or ``None`` at tp=1.
    """

    model: nn.Module
    zero: Optional[ReplicatedZero]
    checkpointed_blocks: list[int]
    tensor_parallel: Optional[TensorParallelInfo] = None


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    tp_plan: Optional[dict[str, str]] = None,
) -> Parallelized:
    """Apply the configured parallelism to ``module`` in place.

    Order: tensor parallelism first (it changes which parameters exist on a rank, and ZeRO must shard what is
    left: FSDP2 then shards each tp-local tensor over dp, the 2-D layout torch's DTensor composes), then
    activation checkpointing, then data-parallel sharding. FSDP2's hooks then sit outside the recomputed region,
    so a block's parameters are gathered once for its backward, recomputation included (the order torchtitan
    uses). Pipeline and expert parallelism will slot in before ZeRO for the same reason as tp.

    Args:
        module: the user's model (a LightningModule), already in its training dtype.
        mesh: the job's meshes from `lightning_par.mesh.build_mesh`.
        config: a resolved config.
        param_dtype: compute dtype for ZeRO-3 gathered parameters under mixed precision.
        reduce_dtype: gradient reduction dtype under ZeRO-3.
        tp_plan: the user's overrides of the inferred tensor-parallel plan (module pattern -> style).
    """
    config.check_supported()
    trunk = find_trunk(module)
    blocks = list(trunk.blocks) if trunk is not None else []
    if config.activation_checkpointing is not None and trunk is None:
        raise ValueError(
            f"activation_checkpointing={config.activation_checkpointing!r} needs a trunk of repeated blocks "
            "(an nn.ModuleList / Sequential / ModuleDict of >= 2 modules of one class); none was found in "
            f"{type(module).__name__}; set activation_checkpointing=None"
        )
    sync_module_states(module, mesh.dp)
    tp_info = None
    if config.tp > 1:
        sync_module_states(module, mesh.tp)  # replicated parameters (embedding, head) must match over tp too
        plan = infer_tp_plan(module, overrides=tp_plan)
        validate_tp(plan, config.tp)
        tp_info = apply_tensor_parallel(module, mesh.tp, plan, sequence_parallel=config.sequence_parallel)
    checkpointed = apply_activation_checkpointing(blocks, config.activation_checkpointing, config.ac_every)
    if config.zero_stage == 3:
        root = StepRoot(module)
        apply_fsdp(root, blocks, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload=config.offload)
        return Parallelized(root, None, checkpointed, tp_info)
    state_mesh = mesh.dp_tp if config.tp > 1 else None
    zero = ReplicatedZero(module, mesh.dp_2d, config.zero_stage, config.bucket_cap_mb, state_mesh=state_mesh)
    return Parallelized(module, zero, checkpointed, tp_info)
