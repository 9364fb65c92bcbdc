"""The one function that fixes the order in which parallel techniques are applied, and says why."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.parallel.expert_parallel import ExpertParallel, apply_expert_parallel
from lightning_par.parallel.zero import apply_fsdp, sync_module_states
from lightning_par.parallel.zero_replicated import ReplicatedZero
from lightning_par.plans.moe import find_moe_layers
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
        experts: the expert parallelism (its gradient reduction runs next to ``zero``'s), or ``None`` when the
            model has no MoE layer.
    """

    model: nn.Module
    zero: Optional[ReplicatedZero]
    checkpointed_blocks: list[int]
    experts: Optional[ExpertParallel] = None


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> Parallelized:
    """Apply the configured parallelism to ``module`` in place.

    Order: expert parallelism first, then activation checkpointing, then data-parallel sharding. Expert
    parallelism changes which parameters exist on a rank (each keeps its ``E/ep`` experts), so it must precede
    ZeRO, which shards what is left and skips the expert shards (their gradients are reduced over the ranks
    holding the same experts, `ExpertParallel.reduce_gradients`); its dispatch hooks sit on the experts module,
    inside any recomputed block, so recomputation replays the same all-to-alls on every rank. Activation
    checkpointing precedes ZeRO so FSDP2's hooks sit outside the recomputed region and a block's parameters are
    gathered once for its backward, recomputation included (the order torchtitan uses). Tensor and pipeline
    parallelism will slot in before expert parallelism, for the same reason.

    Args:
        module: the user's model (a LightningModule), already in its training dtype.
        mesh: the job's meshes from `lightning_par.mesh.build_mesh`.
        config: a resolved config.
        param_dtype: compute dtype for ZeRO-3 gathered parameters under mixed precision.
        reduce_dtype: gradient reduction dtype under ZeRO-3.
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
    sync_module_states(module, mesh.dp)  # before slicing experts: every rank slices the same full weights
    experts = None
    if config.ep > 1 or find_moe_layers(module):
        # Also at ep=1: capacity and balancing statistics span the data-parallel batch, as on one process.
        group = mesh.dp.get_group() if mesh.dp.size() > 1 else None
        experts = apply_expert_parallel(module, mesh.experts, group)
    checkpointed = apply_activation_checkpointing(blocks, config.activation_checkpointing, config.ac_every)
    if config.zero_stage == 3:
        # FSDP2 leaves the expert shards alone: sharding them again over dp would reduce their gradients over
        # every dp rank instead of the ranks holding the same experts. With ep == 1 they shard as any weight.
        root = StepRoot(module)
        ignored = set(experts.params) if experts is not None and experts.params else None
        apply_fsdp(root, blocks, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload=config.offload,
                   ignored_params=ignored)  # fmt: skip
        return Parallelized(root, None, checkpointed, experts)
    exclude = experts.params if experts is not None else ()
    zero = ReplicatedZero(module, mesh.dp_2d, config.zero_stage, config.bucket_cap_mb, exclude=exclude)
    return Parallelized(module, zero, checkpointed, experts)
