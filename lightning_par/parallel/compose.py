"""`parallelize`: the one function that fixes the order in which the parallel techniques are applied, and says why.

torchtitan's shape: the pipeline cuts the model into this rank's stages first; then one flat list of transforms
runs on what is left, each stage (`ModelPart`) treated like a whole model. Adding a dimension is one line here
(docs/design.md, "Adding a dimension").
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from lightning_par.blocks.trunk import Trunk, find_trunk
from lightning_par.checkpoint.dcp import model_state
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.pretrained.load import prepare_pretrained
from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.parallel.compile import apply_compile
from lightning_par.parallel.context.apply import apply_context_parallel
from lightning_par.parallel.experts.apply import apply_expert_parallel
from lightning_par.parallel.experts.finder import find_moe_layers
from lightning_par.parallel.local_sgd.outer import LocalSGD
from lightning_par.parallel.materialize import base_seed, capture_init, has_meta, materialize
from lightning_par.parallel.parts import ModelPart
from lightning_par.parallel.pipeline.split import PipelineSplit, split_pipeline
from lightning_par.parallel.run import ParallelRun
from lightning_par.parallel.tensor.apply import apply_tensor_parallel
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.plan import TPPlan, infer_tp_plan
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.parallel.zero.fsdp import StepRoot, apply_fsdp, sync_module_states
from lightning_par.parallel.zero.replicated import ReplicatedZero


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    tp_plan: Optional[dict[str, str]] = None,
    timeout: Optional[timedelta] = None,
    device: Optional[torch.device] = None,
    pretrained: Optional[str] = None,
) -> ParallelRun:
    """Apply the configured parallelism to ``module`` in place and return what the run needs afterwards.

    Args:
        module: the user's model (a LightningModule), already in its training dtype, on this rank's device.
        mesh: the job's meshes from `lightning_par.mesh.build_mesh`.
        config: a resolved config (`ParallelConfig.resolve`).
        param_dtype: compute dtype for ZeRO-3 gathered parameters under mixed precision.
        reduce_dtype: gradient reduction dtype under ZeRO-3.
        tp_plan: the user's overrides of the inferred tensor-parallel plan (module pattern -> style).
        timeout: collective timeout of process groups created here (a pipeline's tied-weight group, ZeRO's
            deferred all-gather).
        device: this rank's device; needed when the model was built on the meta device (default: where the
            parameters are).
        pretrained: a checkpoint whose weights replace the model's (`lightning_par.checkpoint.pretrained.load`): each
            rank reads its own part, once the model is laid out; a meta-built model is then never initialised.
    """
    trunk = _trunk(module, config)
    # Built on the meta device: every transform below runs on the empty model, then each rank creates and
    # initialises only what it holds (step 6), the same values on every layout (parallel/materialize.py).
    templates = capture_init(module, trunk) if has_meta(module) else None
    ties = tied_names(module)  # before a pipeline cut gives each end stage its own copy
    device = device or _device(module)
    # Inferred on the whole model (one small forward), before a pipeline cut leaves a stage unable to run it.
    plan = _tp_plan(module, config, tp_plan)
    moe_layers = bool(find_moe_layers(module))  # on the whole model: a pipeline stage may hold none of them

    # 1. Pipeline first: it removes other stages' modules, so every later step sees only this rank's parameters.
    cut = _split(module, trunk, mesh, config, timeout, device) if config.pp > 1 else None
    parts = cut.parts if cut is not None else [_whole(module, trunk)]

    # 2. Replicas start equal (ranks may have initialised differently): over data-parallel ranks, and over tp for
    #    the weights tensor parallelism keeps whole (embedding, head), before anything is sliced. A meta-built model
    #    needs none of it: its initialisation does not depend on the rank.
    if templates is None:
        sync_module_states(module, mesh.dp)
        if mesh.cp is not None and mesh.cp.size() > 1:
            sync_module_states(module, mesh.cp)  # cp ranks average gradients too: they must start equal
        if plan is not None:
            sync_module_states(module, mesh.tp)

    # 3. Tensor parallelism decides which slice of each weight a rank holds. Sequence parallelism needs the trunk's
    #    two ends in one part; a stage's boundary activations travel whole.
    for part in parts:
        if plan is not None:
            blocks = None if part.whole_trunk else list(part.blocks)
            sp = config.sequence_parallel if part.whole_trunk else False
            apply_tensor_parallel(module, mesh.tp, plan, sequence_parallel=sp, blocks=blocks)

    # 3b. Context parallelism: hooks on the trunk blocks, after tensor parallelism's, so that its pre-hooks run first
    #     (the sequence is cut to this rank's chunks before sequence parallelism splits it further over tp) and its
    #     exit hook last (gathered over tp before cp). Its attention mode wraps each block's forward before
    #     activation checkpointing (step 5) wraps it, so that recomputation runs under the mode too. Under a
    #     pipeline each stage cuts at its first block and only the trunk's last block gathers: stages exchange
    #     this rank's chunks (the schedule's buffers take the local length).
    if config.cp > 1:
        if trunk is None:
            raise ValueError(
                f"cp={config.cp} needs a trunk of repeated blocks (an nn.ModuleList / Sequential / ModuleDict) to "
                f"split the sequence inside; none was found in {type(module).__name__}; set cp=1"
            )
        assert mesh.cp is not None
        cp_args = (config.cp, mesh.cp.get_local_rank(), mesh.cp.get_group(), config.cp_uneven, config.cp_mode)
        if cut is None:
            apply_context_parallel(list(zip(trunk.names, trunk.blocks)), *cp_args)
        else:
            _cp_under_pipeline(cut, trunk, cp_args)

    # 4. Expert parallelism keeps E/ep experts per rank. Also at ep=1: capacity and balancing statistics then span
    #    the data-parallel batch, as on one process. Its dispatch hooks sit on the experts module, inside any
    #    recomputed block, so recomputation replays the same all-to-alls on every rank. Under a pipeline each stage
    #    shards its own layers; its ep group lies inside the stage (mesh.ExpertMesh) and runs the same schedule, so
    #    each microbatch's all-to-alls line up.
    experts = None
    if config.ep > 1 or moe_layers:
        tokens = mesh.token_mesh  # dp, times cp: under cp each rank's layers see a chunk of its samples' tokens
        group = tokens.get_group() if tokens.size() > 1 else None
        tp_group = mesh.tp.get_group() if config.tp > 1 else None  # tp x ep: who computes which token (expert_tp)
        cp_group = mesh.cp.get_group() if mesh.cp is not None and mesh.cp.size() > 1 else None
        experts = apply_expert_parallel(module, mesh.experts, group, tp_group, config.etp, cp_group,
                                        require_layers=cut is None or not moe_layers)  # fmt: skip

    # 5. Activation checkpointing wraps each block's forward; FSDP2's hooks (next) stay outside the recomputed
    #    region, so a block is gathered once for its backward, recomputation included (torchtitan's order).
    for part in parts:
        apply_activation_checkpointing(part.block_modules, config.activation_checkpointing, config.ac_every, module,
                                       compiled=config.compile)  # fmt: skip

    # 5b. torch.compile per block (torchtitan's order): after activation checkpointing, so that the recomputation is
    #     compiled too, and after tensor parallelism, so that dynamo traces the DTensor redistributions; before FSDP2
    #     and the pipeline's hooks, which stay on the block, outside the compiled forward (parallel/compile.py).
    if config.compile:
        for part in parts:
            apply_compile(part.block_modules)

    # 6. ZeRO shards what is left. ZeRO-3: FSDP2 per part, each block a unit inside the part's root (it shards each
    #    tp-local tensor over dp, the 2-D layout DTensor composes); expert shards are left to expert parallelism
    #    (sharding them again over dp would reduce their gradients over every dp rank, not the ranks holding the
    #    same experts). ZeRO 0-2: our bucketed engine over this rank's parameters, tp-local tensors included.
    #    Under a pipeline the blocks stay gathered from their first forward to the step's end (torchtitan's choice
    #    with pp): torch's schedules keep them gathered from the first backward on anyway, and reduce-scatter and
    #    reshard each stage once per step (docs/pipeline.md, "ZeRO-3 inside stages").
    zero = None
    exclude = experts.params if experts is not None else []
    if config.zero_stage == 3:
        for part in parts:
            apply_fsdp(part.root, part.block_modules, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       offload=config.offload, ignored_params=set(exclude) or None,
                       reshard_after_forward=cut is None)  # fmt: skip
    # A meta-built model now gets storage for what this rank holds, and its values (initialised, or read from the
    # pretrained checkpoint): after FSDP2 sharded it, so that each rank allocates its shards only; before the ZeRO
    # 0-2 engine takes its masters as views of this rank's rows.
    distribute = experts.distribute if experts is not None and experts.params else None
    views = functools.partial(model_state, module, distribute)
    notes: list[str] = []
    # The file is checked against the whole model (names, shapes, every rank alike) before any storage exists.
    shapes = {name: tuple(v.shape) for name, v in views().items()}
    weights = (
        prepare_pretrained(pretrained, shapes, module_type=type(module).__name__, tied=ties, hf_model=module)
        if pretrained
        else None
    )
    if templates is not None:
        skip = weights.names if weights is not None else frozenset()  # read from the file, not initialised
        units = materialize(module, templates, views, device, seed=base_seed(), skip=skip)
        notes.append(f"built on the meta device: {units} unit(s) initialised here")
    if weights is not None:
        weights.read_into(views())
        notes.append(str(weights.report()))
    if config.zero_stage != 3:
        state_mesh = mesh.dp_tp if config.tp > 1 else None
        # A schedule runs several backward passes per step, and its zero-bubble weight passes compute gradients
        # outside autograd's accumulation hooks: stage 2 then reduces after each step's backward. The blocks are the
        # units of the deferred all-gather after the step; not compiled ones: its first step's stale-read check is a
        # TorchFunctionMode over the forward, which dynamo would trace (the whole model is then one unit).
        zero = ReplicatedZero(module, mesh.dp_2d, config.zero_stage, config.bucket_cap_mb, state_mesh=state_mesh,
                              exclude=exclude, reduce_during_backward=cut is None,
                              blocks=parts[0].block_modules if cut is None and not config.compile else (),
                              local_sgd=LocalSGD(config.sync_every, config.outer_lr, config.outer_momentum)
                              if config.sync_every else None, timeout=timeout)  # fmt: skip

    # 7. The pipeline's own hooks last, outside every wrapping above (the recomputed region, FSDP2's pre-hooks); a
    #    tied weight's second copy is marked once ZeRO built its masters (and FSDP2 its sharded parameters).
    if cut is not None:
        cut.install()
        if cut.runner.tied is not None:
            cut.runner.tied.mark_replicas(zero.masters if zero is not None else None)

    # The trainer calls a StepRoot under ZeRO-3 without a pipeline, so that FSDP2's root hooks fire; a pipeline's
    # schedule calls its stage modules itself.
    model = parts[0].root if config.zero_stage == 3 and cut is None else module
    return ParallelRun(
        model=model,
        module=module,
        zero=zero,
        experts=experts,
        pipeline=cut.runner if cut is not None else None,
        norm_groups=(mesh.root.get_group("pp"),) if cut is not None else (),
        notes=tuple(notes),
    )


def _trunk(module: nn.Module, config: ParallelConfig) -> Optional[Trunk]:
    trunk = find_trunk(module)
    if trunk is not None:
        return trunk
    blocks = "a trunk of repeated blocks (an nn.ModuleList / Sequential / ModuleDict of >= 2 modules of one class)"
    where = f"none was found in {type(module).__name__}"
    if config.pp > 1:
        raise ValueError(f"pp={config.pp} needs {blocks} to cut into stages; {where}; set pp=1")
    if config.activation_checkpointing is not None:
        raise ValueError(
            f"activation_checkpointing={config.activation_checkpointing!r} needs {blocks}; {where}; set "
            "activation_checkpointing=None"
        )
    if config.compile:
        raise ValueError(
            f"compile=True compiles each block of {blocks}; {where}; set compile=False and compile the model's "
            "forward yourself (docs/strategies.md, 'torch.compile')"
        )
    return None


def _tp_plan(module: nn.Module, config: ParallelConfig, overrides: Optional[dict[str, str]]) -> Optional[TPPlan]:
    if config.tp == 1:
        return None
    plan = infer_tp_plan(module, overrides=overrides)
    validate_tp(plan, config.tp)
    check_local_shapes(module, plan, config.tp)  # block 0 on per-rank shapes: code assuming full widths fails here
    return plan


def _whole(module: nn.Module, trunk: Optional[Trunk]) -> ModelPart:
    blocks = tuple(zip(trunk.names, trunk.blocks)) if trunk is not None else ()
    return ModelPart(StepRoot(module), blocks, whole_trunk=True)


def tied_names(module: nn.Module) -> dict[str, str]:
    """For each parameter name that shares its tensor with another name, that other name (both directions)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(clean_name(name))
    return {a: b for group in names.values() if len(group) > 1 for a in group for b in group if a != b}


def _device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _cp_under_pipeline(cut: PipelineSplit, trunk: Trunk, cp_args: tuple) -> None:
    model = cut.runner.model
    # The trunk's side outputs (pipeline_sides) travel as the code after the trunk would read them under cp without
    # a pipeline, so nothing here changes them: `lightning_par.nn.MoE` slots carry losses already reduced over the
    # cp ranks (MoE.sample_group), and a Hugging Face router's logits are gathered over the token group dp x cp
    # (moe_router_stats, a hook prepended in step 4) before the stage's capture hook sees them, so every cp rank
    # carries the same whole-microbatch tensor and the gather's backward sums its gradient over dp x cp.
    owned = sorted(model.blocks)
    cpar = apply_context_parallel(
        [(trunk.names[i], model.blocks[i]) for i in owned], *cp_args, indices=owned,
        running=model.running_span, last=len(trunk.blocks) - 1,
    )  # fmt: skip
    cut.runner.wire_shape = cpar.local_shape


def _split(
    module: nn.Module,
    trunk: Optional[Trunk],
    mesh: ParallelMesh,
    config: ParallelConfig,
    timeout: Optional[timedelta],
    device: torch.device,
) -> PipelineSplit:
    assert trunk is not None  # `_trunk` requires one under pp > 1
    return split_pipeline(
        module, trunk, schedule=config.pp_schedule, pp=config.pp, pp_rank=mesh.root.get_local_rank("pp"),
        group=mesh.root.get_group("pp"), microbatches=config.microbatches or 2 * config.pp, device=device,
        split=config.pp_split, costs=config.pp_costs, timeout=timeout,
    )  # fmt: skip
