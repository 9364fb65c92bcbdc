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
from lightning_par.parallel.pipeline_schedule import PipelineRunner, apply_pipeline
from lightning_par.parallel.tensor_parallel import TensorParallelInfo, apply_tensor_parallel
from lightning_par.parallel.zero import apply_fsdp, sync_module_states
from lightning_par.parallel.zero_replicated import ReplicatedZero
from lightning_par.plans.moe import find_moe_layers
from lightning_par.plans.tp import infer_tp_plan
from lightning_par.plans.tp_validate import validate_tp
from lightning_par.plans.trunk import Trunk, find_trunk


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
        checkpointed_blocks: indices of the trunk blocks under activation checkpointing (among this rank's
            blocks under pipeline parallelism).
        experts: the expert parallelism (its gradient reduction runs next to ``zero``'s), or ``None`` when the
            model has no MoE layer.
        tensor_parallel: what tensor parallelism changed, or ``None`` at tp=1.
        pipeline: the runner of pipeline steps when ``pp > 1``.
    """

    model: nn.Module
    zero: Optional[ReplicatedZero]
    checkpointed_blocks: list[int]
    experts: Optional[ExpertParallel] = None
    tensor_parallel: Optional[TensorParallelInfo] = None
    pipeline: Optional[PipelineRunner] = None


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

    Order: the pipeline cut first (it removes other stages' parameters, so every later step sees only this
    rank's), then tensor and expert parallelism (they change which parameters a rank holds: tp-local shards, each
    rank's ``E/ep`` experts), then activation checkpointing, then the pipeline's stage dispatch around the
    (checkpointed) block forwards (the stage swap and stage end must happen outside any recomputed region), then
    data-parallel sharding, which shards what is left: FSDP2 shards each tp-local tensor over dp (the 2-D layout
    torch's DTensor composes); our ZeRO 1-2 engine works on tp-local tensors and skips the expert shards (their
    gradients are reduced over the ranks holding the same experts, `ExpertParallel.reduce_gradients`). The expert
    dispatch hooks sit on the experts module, inside any recomputed block, so recomputation replays the same
    all-to-alls on every rank. FSDP2's hooks sit outside the recomputed region, so a block's parameters are
    gathered once for its backward, recomputation included (the order torchtitan uses). Under pp x tp the plan is
    inferred on the whole model before the cut and applied to the stage's own blocks, without sequence
    parallelism. pp x ep is rejected by `ParallelConfig.check_supported` for now.

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
    plan = None
    if config.tp > 1:
        # Inferred on the whole model (one small forward), before a pipeline cut leaves a stage unable to run it.
        plan = infer_tp_plan(module, overrides=tp_plan)
        validate_tp(plan, config.tp)
    runner = None
    if config.pp > 1:
        runner = _cut_pipeline(module, trunk, mesh, config)
        blocks = runner.model.owned_blocks
    # Over the data-parallel ranks (of this rank's own stage under pp): before slicing tp shards or experts, every
    # rank slices the same full weights.
    sync_module_states(module, mesh.dp)
    tp_info = None
    if plan is not None:
        sync_module_states(module, mesh.tp)  # replicated parameters (embedding, head) must match over tp too
        stage_blocks = None
        if runner is not None and trunk is not None:  # only this stage's blocks
            stage_blocks = [(trunk.names[i], b) for i, b in sorted(runner.model.blocks.items())]
        tp_info = apply_tensor_parallel(
            module, mesh.tp, plan, sequence_parallel=config.sequence_parallel, blocks=stage_blocks
        )
    experts = None
    if config.ep > 1 or find_moe_layers(module):
        # Also at ep=1: capacity and balancing statistics span the data-parallel batch, as on one process.
        group = mesh.dp.get_group() if mesh.dp.size() > 1 else None
        experts = apply_expert_parallel(module, mesh.experts, group)
    checkpointed = apply_activation_checkpointing(blocks, config.activation_checkpointing, config.ac_every)
    if runner is not None:
        runner.model.install()
    if config.zero_stage == 3 and runner is not None:
        # One FSDP2 root per stage module (it owns the embedding / head; the schedule calls it, so its hooks
        # fire), the stage's blocks as units inside it. Only the single-stage schedules (config.py says why).
        for stage in runner.model.stage_modules():
            owned = [runner.model.blocks[i] for i in range(stage.spec.start, stage.spec.end)]
            apply_fsdp(stage, owned, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        runner.model.install_probe_hooks()  # after FSDP2's pre-hooks: a probe must not gather blocks
        return Parallelized(module, None, checkpointed, experts, tp_info, runner)
    if runner is not None:
        runner.model.install_probe_hooks()
    if config.zero_stage == 3:
        # FSDP2 leaves the expert shards alone: sharding them again over dp would reduce their gradients over
        # every dp rank instead of the ranks holding the same experts. With ep == 1 they shard as any weight.
        root = StepRoot(module)
        ignored = set(experts.params) if experts is not None and experts.params else None
        apply_fsdp(root, blocks, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload=config.offload,
                   ignored_params=ignored)  # fmt: skip
        return Parallelized(root, None, checkpointed, experts, tp_info, runner)
    state_mesh = mesh.dp_tp if config.tp > 1 else None
    exclude = experts.params if experts is not None else ()
    zero = ReplicatedZero(
        module, mesh.dp_2d, config.zero_stage, config.bucket_cap_mb, state_mesh=state_mesh, exclude=exclude
    )
    if runner is not None and zero.stage == 2:
        # The schedules compute weight gradients outside autograd's accumulation hooks (zero-bubble W passes),
        # so under a pipeline ZeRO-2 reduce-scatters every bucket once per step instead (see docs/pipeline.md).
        zero.remove_hooks()
    return Parallelized(module, zero, checkpointed, experts, tp_info, runner)


def _cut_pipeline(
    module: nn.Module, trunk: Optional[Trunk], mesh: ParallelMesh, config: ParallelConfig
) -> PipelineRunner:
    if trunk is None:
        raise ValueError(
            f"pp={config.pp} needs a trunk of repeated blocks (an nn.ModuleList / Sequential / ModuleDict of >= 2 "
            f"modules of one class) to cut into stages; none was found in {type(module).__name__}; set pp=1"
        )
    device = next(module.parameters()).device
    return apply_pipeline(
        module, trunk, schedule=config.pp_schedule, pp=config.pp, pp_rank=mesh.root.get_local_rank("pp"),
        group=mesh.root.get_group("pp"), microbatches=config.microbatches or 2 * config.pp, device=device,
        split=config.pp_split, costs=config.pp_costs,
    )  # fmt: skip
