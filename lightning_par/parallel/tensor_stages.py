"""Step 3 of `lightning_par.parallel.compose.parallelize`: the tensor-parallel plans of the trunk and of other stacks,
applied to each part (the whole model, or a pipeline stage's blocks), and sequence parallelism across pipeline
stages (each stage hands on its tp rank's sequence shard; the pipeline tells later stages the true length)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from torch import nn

from lightning_par.blocks.trunk import Trunk, trunk_at
from lightning_par.config import ParallelConfig
from lightning_par.mesh import ParallelMesh
from lightning_par.parallel.parts import ModelPart
from lightning_par.parallel.pipeline.schedule import Shape
from lightning_par.parallel.pipeline.split import PipelineSplit
from lightning_par.parallel.tensor.adapters import as_planned
from lightning_par.parallel.tensor.apply import apply_tensor_parallel
from lightning_par.parallel.tensor.check import check_local_shapes, other_plans, preflight, tp_report
from lightning_par.parallel.tensor.plan import TPPlan, infer_tp_plan
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.parallel.tensor.sequence import Gather, SequenceState


def tp_plans(
    module: nn.Module, config: ParallelConfig, overrides: Optional[dict[str, str]], trunk: Optional[Trunk] = None
) -> tuple[list[TPPlan], list[str]]:
    """The trunk's plan (``trunk``: the one the user named), then other stacks' (an encoder-decoder's encoder), and a
    note per stack kept whole."""
    if config.tp == 1:
        return [], []
    with as_planned(module):  # DoRA as LoRA, a 4-bit base as its values: each split by its own rule later
        plan = infer_tp_plan(module, overrides=overrides, trunk=trunk)
        validate_tp(plan, config.tp)
        # Block 0 on per-rank shapes: code assuming full widths runs on gathered activations, or is refused here.
        plan = check_local_shapes(module, plan, config.tp)
        stacks, notes = other_plans(module, plan, config.tp, overrides)
    return [plan, *stacks], notes


def tensor_parallel(module: nn.Module, parts: list[ModelPart], mesh: ParallelMesh, plans: list[TPPlan],
                     sp: Optional[bool], trunk: Optional[Trunk], cut: Optional[PipelineSplit],
                     gathers: Optional[Callable[[str], Optional[Gather]]] = None,
                     ) -> tuple[str, list[tuple[int, SequenceState]]]:  # fmt: skip
    """Step 3. Under a pipeline each stage's part keeps sequence parallelism wherever it is exact: the trunk's first
    block scatters the sequence, its last gathers it, and the stages between hand on each rank's shard (not under a
    trunk whose blocks run more than once, whose calls a stage cannot tell apart). ``plans``: the trunk's, then
    other stacks' (sequence parallelism there wherever it is exact; under a pipeline, on the rank whose stage holds
    the stack, without it). Returns the start-up line saying what was split and what kept whole, and, where the
    stages exchange sequence shards, each stage part's first block (trunk index) with its hooks' state. ``gathers``:
    the trunk regions' own all-gathers under sequence parallelism (`apply_tensor_parallel`)."""
    plan, stacks = plans[0], plans[1:]
    sequence_parallel = sp
    staged: list[tuple[int, SequenceState]] = []
    for part in parts:
        blocks = None if part.whole_trunk else list(part.blocks)
        calls = cut is not None and bool(cut.model.shared)
        sequence_parallel = sp if part.whole_trunk or not calls else False
        names = [n for n, _ in part.blocks]
        ends = (True, True) if part.whole_trunk or trunk is None else (
            trunk.names[0] in names[:1], trunk.names[-1] in names[-1:])  # fmt: skip
        info = apply_tensor_parallel(module, mesh.tp, plan, sequence_parallel=sequence_parallel, blocks=blocks,
                                     ends=ends, gathers=gathers)  # fmt: skip
        sequence_parallel = info.sequence_parallel
        if info.sequence is not None and not part.whole_trunk and trunk is not None:
            staged.append((trunk.names.index(names[0]), info.sequence))
    whole = parts[0].whole_trunk
    held = []
    for other in stacks:
        blocks = [(n, module.get_submodule(n)) for n in _stack_names(module, other)]
        if not whole and not all(any(True for _ in b.parameters()) for _, b in blocks):
            continue  # another stage holds it (this rank has its stand-ins)
        apply_tensor_parallel(module, mesh.tp, other, sequence_parallel=None if whole and sp is not False else False,
                              blocks=None if whole else blocks)  # fmt: skip
        held.append(other)
    # Where the plan's probe ran the whole model (a pipeline stage cannot run it alone: its own pre-flight does).
    if parts[0].whole_trunk and plan.traced:
        preflight(module, mesh.tp.size(), bool(sequence_parallel))
    split = [b for part in parts for b in part.blocks]
    split += [(n, module.get_submodule(n)) for other in held for n in _stack_names(module, other)]
    return tp_report(split, mesh.tp.size(), [g for p in [plan, *held] for g in p.gathered]), staged


def tell_lengths(staged: list[tuple[int, SequenceState]], cp_shape: Optional[Callable[[Shape], Shape]],
                  shapes: list[Shape]) -> None:  # fmt: skip
    """The true sequence length each stage part's regions cut the stream back to: the hidden state's length
    entering its first block (this rank's context-parallel chunks under cp)."""
    for start, state in staged:
        shape = shapes[start] if start < len(shapes) else shapes[-1]
        state.length = (cp_shape(shape) if cp_shape is not None else shape)[1]


def sequence_shard(inner: Optional[Callable[[Shape], Shape]], tp: int) -> Callable[[Shape], Shape]:
    """The shape a stage boundary travels in: ``inner``'s (context parallelism's chunks), its sequence over tp."""

    def shape(full: Shape) -> Shape:
        local = inner(full) if inner is not None else full
        return (local[0], -(-local[1] // tp), *local[2:])  # the stream padded to a multiple of tp

    return shape


def _stack_names(module: nn.Module, plan: TPPlan) -> list[str]:
    stack = trunk_at(module, plan.trunk)
    return list(stack.names) if stack is not None else []
