"""`parallelize`: the one function that fixes the order in which the parallel techniques are applied, and says why.

torchtitan's shape: the pipeline cuts the model into this rank's stages first; then one flat list of transforms
runs on what is left, each stage (`ModelPart`) treated like a whole model. Adding a dimension is one line here
(docs/design.md, "Adding a dimension").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from lightning_par.blocks.trunk import Trunk, find_trunk, named_trunk
from lightning_par.checkpoint.dcp import model_state
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.pretrained.load import prepare_pretrained
from lightning_par.checkpoint.pretrained.names import AdapterNames
from lightning_par.checkpoint.pretrained.peft_in import Sources, peft_view, split_sources
from lightning_par.checkpoint.pretrained.sources import PretrainedError
from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.parallel.compile import apply_compile
from lightning_par.parallel.compression import PowerSGD, PowerSGDSettings
from lightning_par.parallel.compression.quantized import QuantizedAllGather
from lightning_par.parallel.context.apply import apply_context_parallel
from lightning_par.parallel.context.check import check_blocks_run_once
from lightning_par.parallel.experts.apply import ExpertParallel, apply_expert_parallel
from lightning_par.parallel.experts.finder import find_moe_layers
from lightning_par.parallel.fp8 import (
    BytesAllGather,
    check_fp8_device,
    convert_fp8,
    fp8_gathers,
    gather_note,
    gather_ready,
    precompute_scales,
    select_fp8,
)
from lightning_par.parallel.local_sgd.outer import LocalSGD
from lightning_par.parallel.materialize import InitTemplates, base_seed, capture_init, has_meta, materialize
from lightning_par.parallel.parts import ModelPart
from lightning_par.parallel.pipeline.schedule import PipelineRunner, Shape
from lightning_par.parallel.pipeline.slots import PipelineError
from lightning_par.parallel.pipeline.split import PipelineSplit, split_pipeline
from lightning_par.parallel.run import ParallelRun
from lightning_par.parallel.tensor.adapters import adapter_names
from lightning_par.parallel.tensor.plan_types import TPPlan
from lightning_par.parallel.tensor.sequence import Gather, SequenceState
from lightning_par.parallel.tensor_stages import sequence_shard, tell_lengths, tensor_parallel, tp_plans
from lightning_par.parallel.zero.fsdp import StepRoot, apply_fsdp, sync_module_states
from lightning_par.parallel.zero.replicated import ReplicatedZero
from lightning_par.parallel.zero.scalars import ScalarGrads, scalar_params


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
    pretrained: Sources = None,
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
            rank reads its own part, once the model is laid out; a meta-built model is then never initialised. A
            list: the base first, then PEFT adapter folders that fill the model's adapters
            (`lightning_par.checkpoint.pretrained.peft_in`).
    """
    # Read on the whole model, before a pipeline cut leaves a stage unable to run it: the trunk, the initialisers of
    # a meta-built model (values come in step 7, parallel/materialize.py), tied names (each end stage gets a copy),
    # the tensor-parallel plan (one small forward) and whether there are MoE layers (a stage may hold none).
    trunk = _trunk(module, config)
    templates = capture_init(module, trunk) if has_meta(module) else None
    ties, device = tied_names(module), device or _device(module)
    base, adapter_files = split_sources(pretrained)
    # A base checkpoint fills the layers the adapters wrap; a PEFT folder, the adapters.
    adapters = adapter_names(module) if base or adapter_files else None
    plans, stack_notes = tp_plans(module, config, tp_plan, trunk if config.trunk else None)
    if config.cp > 1 and trunk is not None:
        check_blocks_run_once(module, trunk)  # a recurrent-depth loop, even one run without gradients
    moe_layers = [layer.name for layer in find_moe_layers(module)]
    # fp8 swaps layers for torchao's: before any layout holds them (the initialisers were read from the originals).
    fp8_notes, gathers = _fp8(module, trunk, moe_layers, plans, config, device) if config.fp8 else ([], None)
    # 1. The pipeline first: it removes other stages' modules, so every later step sees only this rank's parameters.
    cut = _split(module, trunk, mesh, config, timeout, device) if config.pp > 1 else None
    parts = cut.parts if cut is not None else [_whole(module, trunk)]
    # 2. Replicas start equal, before anything is sliced (a meta-built model's values do not depend on the rank).
    if templates is None:
        _sync_replicas(module, mesh, bool(plans))
    # 3. Tensor parallelism: which slice of each weight a rank holds.
    tp_line, staged = tensor_parallel(module, parts, mesh, plans, config.sequence_parallel, trunk, cut, gathers) \
        if plans else ("", [])  # fmt: skip
    tp_notes = [*fp8_notes, tp_line, *stack_notes] if plans else fp8_notes
    # 4. Context parallelism: hooks after tensor parallelism's, attention modes before recomputation wraps them.
    cp_shape = _context_parallel(module, trunk, cut, mesh, config) if config.cp > 1 else None
    # 5. Expert parallelism: dispatch hooks on the experts module, inside any recomputed block.
    experts = _expert_parallel(module, mesh, config, cut, bool(moe_layers)) if config.ep > 1 or moe_layers else None
    # 6. Activation checkpointing, then torch.compile per block, then FSDP2 (ZeRO-3) outside both.
    _checkpoint_and_compile(module, parts, trunk, config)
    exclude = list(experts.params) if experts is not None else []
    # 0-dim parameters stay whole on every rank under every ZeRO stage, their gradients averaged apart (scalars.py).
    scalars = _scalars(module, mesh, config, exclude)
    exclude += [p for _, p in scalars.named]
    if config.zero_stage == 3:
        _fsdp(parts, mesh, config, exclude, param_dtype, reduce_dtype, pipelined=cut is not None)
    # 7. A meta-built model gets storage for what this rank holds, and values: initialised, or read from `pretrained`.
    notes = tp_notes + _values(module, experts, templates, (base, adapters, adapter_files), ties, device)
    # 8. ZeRO 0-2: the bucketed engine, whose masters are views of the values just set.
    zero = None if config.zero_stage == 3 else _replicated_zero(module, parts, mesh, config, exclude, cut, timeout)
    # 9. The pipeline's own hooks last, outside every wrapping above; a tied weight's second copy marked after ZeRO.
    runner = _install(cut, cp_shape, staged, mesh, zero) if cut is not None else None
    # Under ZeRO-3 without a pipeline the trainer calls the StepRoot, so that FSDP2's root hooks fire.
    model = parts[0].root if config.zero_stage == 3 and cut is None else module
    norm_groups = (mesh.root.get_group("pp"),) if cut is not None else ()
    return ParallelRun(model=model, module=module, zero=zero, experts=experts, norm_groups=norm_groups,
                       pipeline=runner, notes=tuple(notes), scalars=scalars)  # fmt: skip


def _install(cut: PipelineSplit, cp_shape: Optional[Callable[[Shape], Shape]],
             staged: list[tuple[int, SequenceState]], mesh: ParallelMesh,
             zero: Optional[ReplicatedZero]) -> PipelineRunner:  # fmt: skip
    """Step 9: the stages send what context parallelism keeps of the hidden state (``cp_shape``), and of that this
    tp rank's sequence shard where the stages keep sequence parallelism (``staged``: their hooks then learn the
    true length before each step); a tied weight's second copy is marked once ZeRO built its masters."""
    wire = sequence_shard(cp_shape, mesh.tp.size()) if staged else cp_shape
    runner = cut.install(wire)
    if staged:
        runner.shape_listeners.append(functools.partial(tell_lengths, staged, cp_shape))
    cut.mark_replicas(zero.masters if zero is not None else None)
    return runner


def _checkpoint_and_compile(module: nn.Module, parts: list[ModelPart], trunk: Optional[Trunk],
                            config: ParallelConfig) -> None:  # fmt: skip
    """Step 6, per part: activation checkpointing (offload: the trunk's first ``offload_blocks`` blocks, wherever
    they sit, a prefix of each part's), then `torch.compile` of each block."""
    first = set(trunk.names[: config.offload_blocks]) if config.offload_blocks and trunk else None
    for part in parts:
        count = None if first is None else sum(n in first for n, _ in part.blocks)
        apply_activation_checkpointing(part.block_modules, config.activation_checkpointing, config.ac_every, module,
                                       compiled=config.compile, count=count)  # fmt: skip
        if config.compile:
            apply_compile(part.block_modules)


def _sync_replicas(module: nn.Module, mesh: ParallelMesh, tensor_parallel: bool) -> None:
    """Step 2: ranks may have initialised differently. Over the data-parallel ranks; over cp, whose ranks average
    gradients too; and over tp for the weights tensor parallelism keeps whole (embedding, head)."""
    sync_module_states(module, mesh.dp)
    if mesh.cp is not None and mesh.cp.size() > 1:
        sync_module_states(module, mesh.cp)
    if tensor_parallel:
        sync_module_states(module, mesh.tp)


def _context_parallel(module: nn.Module, trunk: Optional[Trunk], cut: Optional[PipelineSplit], mesh: ParallelMesh,
                      config: ParallelConfig) -> Optional[Callable[[Shape], Shape]]:  # fmt: skip
    """Step 4: hooks on the trunk blocks, after tensor parallelism's, so that its pre-hooks run first (the sequence
    is cut to this rank's chunks before sequence parallelism splits it further over tp) and its exit hook last
    (gathered over tp before cp). Its attention mode wraps each block's forward before activation checkpointing
    wraps it, so that recomputation runs under the mode too. Under a pipeline each stage cuts at its first block and
    only the trunk's last block gathers: stages exchange this rank's chunks (the schedule's buffers take the local
    length): returns the shape they travel in, for the pipeline's runner."""
    if trunk is None:
        raise ValueError(
            f"cp={config.cp} needs a trunk of repeated blocks (an nn.ModuleList / Sequential / ModuleDict) to "
            f"split the sequence inside; none was found in {type(module).__name__}; set cp=1"
        )
    assert mesh.cp is not None
    cp_args = (config.cp, mesh.cp.get_local_rank(), mesh.cp.get_group(), config.cp_uneven, config.cp_mode)
    if cut is None:
        apply_context_parallel(list(zip(trunk.names, trunk.blocks)), *cp_args)
        return None
    return _cp_under_pipeline(cut, trunk, cp_args)


def _expert_parallel(module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, cut: Optional[PipelineSplit],
                     moe_layers: bool) -> ExpertParallel:  # fmt: skip
    """Step 5: E/ep experts per rank; also at ep=1, where capacity and balancing statistics then span the
    data-parallel batch, as on one process. Its dispatch hooks sit on the experts module, inside any recomputed
    block, so recomputation replays the same all-to-alls on every rank. Under a pipeline each stage shards its own
    layers; its ep group lies inside the stage (mesh.ExpertMesh) and runs the same schedule, so each microbatch's
    all-to-alls line up."""
    tokens = mesh.token_mesh  # dp, times cp: under cp each rank's layers see a chunk of its samples' tokens
    group = tokens.get_group() if tokens.size() > 1 else None
    tp_group = mesh.tp.get_group() if config.tp > 1 else None  # tp x ep: who computes which token (experts.with_tp)
    cp_group = mesh.cp.get_group() if mesh.cp is not None and mesh.cp.size() > 1 else None
    return apply_expert_parallel(module, mesh.experts, group, tp_group, config.etp, cp_group,
                                 require_layers=cut is None or not moe_layers)  # fmt: skip


def _fsdp(parts: list[ModelPart], mesh: ParallelMesh, config: ParallelConfig, exclude: list[nn.Parameter],
          param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
          pipelined: bool) -> None:  # fmt: skip
    """Step 6, ZeRO-3: FSDP2 per part, each block a unit inside the part's root (it shards each tp-local tensor over
    dp, the 2-D layout DTensor composes), outside the recomputed region so that a block is gathered once for its
    backward (torchtitan's order). Expert shards are left to expert parallelism: sharding them again over dp would
    reduce their gradients over every dp rank, not the ranks holding the same experts. Under a pipeline the blocks
    stay gathered from their first forward to the step's end (torchtitan's choice with pp): torch's schedules keep
    them gathered from the first backward on anyway (docs/pipeline.md, "ZeRO-3 inside stages")."""
    for part in parts:
        apply_fsdp(part.root, part.block_modules, mesh.dp_2d, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   offload=config.offload, ignored_params=set(exclude) or None,
                   reshard_after_forward=not pipelined,
                   all_gather=QuantizedAllGather() if config.zero_quantized_weights else
                   BytesAllGather() if config.fp8 else None)  # fmt: skip
        if config.fp8:  # every fp8 weight's scale from the whole weight, not one tp rank's slice (fp8/scales.py)
            precompute_scales(part.root)


def _values(module: nn.Module, experts: Optional[ExpertParallel], templates: Optional[InitTemplates],
            source: tuple[Optional[str], Optional[AdapterNames], tuple[str, ...]], ties: dict[str, str],
            device: torch.device) -> list[str]:  # fmt: skip
    """Step 7: after FSDP2 sharded the model, so that each rank allocates its shards only; before the ZeRO 0-2
    engine takes its masters as views of this rank's rows. The pretrained file is checked against the whole model
    (names, shapes, every rank alike) before any storage exists. Returns start-up notes."""
    distribute = experts.distribute if experts is not None and experts.params else None
    views = functools.partial(model_state, module, distribute)
    notes: list[str] = []
    pretrained, adapters, adapter_files = source
    shapes = {name: tuple(v.shape) for name, v in views().items()}
    weights = (prepare_pretrained(pretrained, shapes, module_type=type(module).__name__, tied=ties, hf_model=module,
                                  adapters=adapters) if pretrained else None)  # fmt: skip
    plans = [weights] if weights is not None else []
    for file in adapter_files:  # every adapter of the model from the file, and nothing else, or refused
        view = peft_view(adapters.fresh if adapters is not None else ())
        if not view.aliases:
            raise PretrainedError(
                f"{file} holds low-rank adapters and {type(module).__name__} has none: wrap the model with peft's "
                "get_peft_model (the same LoraConfig) before it is laid out"
            )
        mine = {n: shapes[n] for n in view.aliases if n in shapes}  # a pipeline stage: its own (ranks unite them)
        plans.append(prepare_pretrained(file, mine, module_type=type(module).__name__,
                                        adapters=view))  # fmt: skip
    if templates is not None:
        skip = frozenset().union(*(p.names for p in plans))  # read from the files, not initialised
        units = materialize(module, templates, views, device, seed=base_seed(), skip=skip)
        notes.append(f"built on the meta device: {units} unit(s) initialised here")
    for i, plan in enumerate(plans):
        plan.read_into(views())
        report = plan.report()
        # The base's adapter tensors do not keep their values when a PEFT folder fills them next.
        notes.append(str(dataclasses.replace(report, fresh=0) if i == 0 and adapter_files else report))
    return notes


def _replicated_zero(module: nn.Module, parts: list[ModelPart], mesh: ParallelMesh, config: ParallelConfig,
                     exclude: list[nn.Parameter], cut: Optional[PipelineSplit],
                     timeout: Optional[timedelta]) -> ReplicatedZero:  # fmt: skip
    """Step 8, ZeRO 0-2 over this rank's parameters, tp-local tensors included. A schedule runs several backward
    passes per step, and its zero-bubble weight passes compute gradients outside autograd's accumulation hooks:
    stage 2 then reduces after each step's backward. The blocks are the units of the deferred all-gather after the
    step; not compiled ones: its first step's stale-read check is a TorchFunctionMode over the forward, which dynamo
    would trace (the whole model is then one unit)."""
    local_sgd = LocalSGD(config.sync_every, config.outer_lr, config.outer_momentum) if config.sync_every else None
    compression = None
    if config.grad_compression == "powersgd":  # config: ZeRO 0-1 over the data-parallel ranks, with or without pp
        # A pipeline's copies of one weight (a tied weight's two ends, what every stage holds) must stay equal, and
        # each stage compresses with a state of its own: their mean is exact.
        copies = [p for held in (cut.tied, cut.everywhere) if held is not None for p in held.params()] if cut else []
        settings = PowerSGDSettings(config.compression_rank, config.compression_start)
        compression = PowerSGD(mesh.dp.get_group(), settings, exact=copies)  # every replica's ranks, as one
    return ReplicatedZero(module, mesh.dp_2d, config.zero_stage, config.bucket_cap_mb,
                          state_mesh=mesh.dp_tp if config.tp > 1 else None, exclude=exclude,
                          reduce_during_backward=cut is None,
                          blocks=parts[0].block_modules if cut is None and not config.compile else (),
                          local_sgd=local_sgd, timeout=timeout, compression=compression)  # fmt: skip


def _scalars(module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, exclude: list[nn.Parameter]) -> ScalarGrads:
    """This rank's trainable 0-dim parameters, averaged over the ranks the others are averaged over: every
    data-parallel rank (``cp`` inside ``dp_shard``), or each replica's ``dp_shard`` alone under local SGD."""
    dp = mesh.dp_2d
    groups = [dp.get_group(1)] if config.sync_every else [dp.get_group(0), dp.get_group(1)]
    size = dp.size(1) if config.sync_every else dp.size()
    return ScalarGrads(scalar_params(module, exclude), groups, size)


def _fp8(module: nn.Module, trunk: Optional[Trunk], moe: list[str], plans: list[TPPlan], config: ParallelConfig,
         device: torch.device) -> tuple[list[str], Optional[Callable[[str], Optional[Gather]]]]:  # fmt: skip
    """fp8 training (parallel/fp8): the trunk's eligible linear layers become torchao's, whose weights ZeRO-3 then
    all-gathers in fp8, as sequence parallelism does the inputs of the regions only fp8 projections read. Returns the
    start-up lines naming what is in fp8 and what is kept, and why, and those regions' gathers."""
    check_fp8_device(config.fp8, device)
    layers = select_fp8(module, trunk, moe, plans, config.tp)
    sp = config.tp > 1 and config.sequence_parallel is not False
    ready = gather_ready(module, plans, set(layers.converted)) if sp else {}  # a probe of the unconverted model
    convert_fp8(module, layers, emulate=config.fp8 == "emulate", zero3=config.zero_stage == 3)
    return [*layers.notes(), *gather_note(ready)], fp8_gathers(module, ready) if ready else None


def _trunk(module: nn.Module, config: ParallelConfig) -> Optional[Trunk]:
    if config.trunk is not None:  # the user's hint
        return named_trunk(module, config.trunk)
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


def _cp_under_pipeline(cut: PipelineSplit, trunk: Trunk, cp_args: tuple) -> Callable[[Shape], Shape]:
    model = cut.model
    # The trunk's side outputs (pipeline.sides) travel as the code after the trunk would read them under cp without
    # a pipeline, so nothing here changes them: `lightning_par.nn.MoE` slots carry losses already reduced over the
    # cp ranks (MoE.sample_group), and a Hugging Face router's logits are gathered over the token group dp x cp
    # (experts.router_stats, a hook prepended in step 5) before the stage's capture hook sees them, so every cp rank
    # carries the same whole-microbatch tensor and the gather's backward sums its gradient over dp x cp.
    owned = sorted(model.blocks)
    cpar = apply_context_parallel(
        [(trunk.names[i], model.blocks[i]) for i in owned], *cp_args, indices=owned,
        running=model.running_span, last=len(trunk.blocks) - 1,
    )  # fmt: skip
    return cpar.local_shape


def _split(
    module: nn.Module,
    trunk: Optional[Trunk],
    mesh: ParallelMesh,
    config: ParallelConfig,
    timeout: Optional[timedelta],
    device: torch.device,
) -> PipelineSplit:
    assert trunk is not None  # `_trunk` requires one under pp > 1
    cut = split_pipeline(
        module, trunk, schedule=config.pp_schedule, pp=config.pp, pp_rank=mesh.root.get_local_rank("pp"),
        group=mesh.root.get_group("pp"), microbatches=config.microbatches or 2 * config.pp, device=device,
        split=config.pp_split, costs=config.pp_costs, timeout=timeout, vpp=config.vpp,
    )  # fmt: skip
    if config.zero_stage == 3 and cut.everywhere is not None:
        runs = "runs" if len(cut.model.shared) == 1 else "run"
        why = (f"{', '.join(cut.model.shared)} {runs} more than once in one forward" if cut.model.shared else
               f"{', '.join(cut.everywhere.names)} sit on a module that contains the trunk")  # fmt: skip
        raise PipelineError(
            f"{why}, so every pipeline stage holds them; ZeRO-3 would shard them inside one stage's unit while other "
            "stages' code reads them too. Use zero_stage=1 or 2 with the pipeline (e.g. strategy='pipe_zero1')"
        )
    return cut
