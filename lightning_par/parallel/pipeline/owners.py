"""Which pipeline stage owns each module outside the trunk (decided by what runs before and after the trunk).

Registration order is no guide (litgpt's ``GPT`` registers ``lm_head`` before ``transformer``, which holds the
embedding, the blocks and the final norm), so `find_ownership` runs the model's forward once on a tiny input and
records, for every outer module with parameters (a *unit*), whether its parameters were used (a forward of the
module, or a functional use such as ``F.linear(h, self.wte.weight)``) before the first trunk block started or
after the last one ended. Units used before the trunk belong to the first stage, units used after it to the last,
units used on both sides to both (a tied embedding used as the head), units never used to the first stage (they
stay in checkpoints). A parameter held by a unit of each side is *tied*: `lightning_par.parallel.pipeline.tied`
keeps a copy on each end stage and sums their gradients. Where the probe cannot run (a forward that wants more than
token ids, with no ``example_input_array``), registration order decides, as it always did.

On a stage that does not own a unit, `pipeline.standins.shadow` puts a meta-device copy of the unit's whole subtree
in its place.

A block that runs more than once in one forward (ALBERT's one layer at every depth, a recurrent-depth loop such as
Dory's ``[0, 1, 2, 1, 2, 3]``) makes the trunk one of calls (`Trunk.calls`, `Ownership.calls`): the probe runs again
with a place per call, the stages cut the calls in the order the forward makes them, and every stage holds the
blocks that run more than once, their gradients summed over the pipeline (`Ownership.everywhere`).

The probe does not depend on the parameters' values, only on the order of calls; it runs without gradients, in
eval mode (no dropout) and with the RNG state restored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from torch import nn

from lightning_par import _compat
from lightning_par.blocks._probe import out_of_order, probe_call
from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.pipeline.meta import check_stand_ins
from lightning_par.parallel.pipeline.probe import Units, Uses, probe_forward
from lightning_par.parallel.pipeline.slots import PipelineError, SideSlot, carried_slots, moe_loss_slots, side_slots

__all__ = ["Ownership", "PipelineError", "SideSlot", "find_ownership", "outer_units"]


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Where the modules outside the trunk run.

    Args:
        pre: units the first stage owns (used before the trunk, or never), in registration order.
        post: units the last stage owns (used after the trunk), in registration order; a unit used on both sides
            is in both lists.
        tied: parameters held by a unit of each list, each as its names in the whole model (the first is the name
            ``named_parameters`` gives it: the one an optimizer and the one-process checkpoint key it by).
        source: ``"probe"`` (decided by a run of the forward) or ``"registration order"`` (the probe could not run:
            ``reason`` says why).
        sides: tensors modules inside the trunk return and code after the trunk reads (router logits collected for
            a load-balancing loss), in the order they are made; the stages carry them with the hidden state
            (`lightning_par.parallel.pipeline.sides`).
        cut_conflicts: the blocks a stage may not start at, each with the first read that a cut there would get
            wrong (`lightning_par.parallel.pipeline.cuts`); empty when the probe could not run.
        everywhere: parameters directly on a module that contains the trunk (`everywhere_params`): every stage holds
            them and their gradients are summed over the pipeline (`pipeline.tied.OnEveryStage`).
        calls: where a block runs more than once in one forward (ALBERT, a recurrent-depth loop), the trunk as the
            forward runs it (`Trunk.calls`): the pipeline cuts its calls, and the parameters of the blocks that
            run more than once are in ``everywhere``; ``None`` where every block runs once, in order.
        reshaped: the blocks that return more than a hidden state of their input's shape (Swin's stages return
            ``(hidden, hidden before merging, dimensions)`` at a new length and width): a stage they run before
            hands on what their meta-device forward returns, not their first argument (`pipeline.meta.check_stand_ins`).
    """

    pre: Units
    post: Units
    tied: list[tuple[str, ...]]
    source: str
    reason: str = ""
    sides: tuple[SideSlot, ...] = ()
    cut_conflicts: dict[int, str] = dataclasses.field(default_factory=dict)
    reshaped: tuple[int, ...] = ()
    everywhere: tuple[str, ...] = ()
    calls: Optional[Trunk] = None

    def why(self, before: bool) -> str:
        """How a unit of the first (``before``) or last stage got there, for error messages."""
        side = "before" if before else "after"
        if self.source == "probe":
            return f"it ran {side} the trunk when the pipeline probed the model's forward"
        return f"it is registered {side} the trunk; the probe of the forward could not run: {self.reason}"


def outer_units(module: nn.Module, trunk: Trunk) -> Units:
    """The outermost modules with parameters outside the trunk, in registration order (the ownership units).

    A parameter directly on a module that contains the trunk is no unit's (`everywhere_params`).

    Raises:
        PipelineError: a parameter is shared with a trunk block.
    """
    units: Units = []
    prefix = trunk.path + "."
    for name, m in module.named_modules():
        if name == trunk.path or name.startswith(prefix) or any(name.startswith(n + ".") for n, _ in units):
            continue
        direct = [n for n, p in _compat.module_parameters(m).items() if p is not None]
        if not direct or name == "" or prefix.startswith(name + "."):
            continue
        units.append((name, m))
    trunk_ids = {id(p) for b in trunk.blocks for p in b.parameters()}
    for name, m in units:
        for pname, p in m.named_parameters():
            if id(p) in trunk_ids:
                raise PipelineError(f"{name}.{pname} is shared with a trunk block; stages cannot share parameters")
    return units


def everywhere_params(module: nn.Module, trunk: Trunk) -> tuple[str, ...]:
    """Names of the parameters directly on a module that contains the trunk (the model itself, a wrapper around the
    trunk): modded-nanoGPT's scalars, a learned scale on the embedding. No stage can own them alone, so every stage
    holds them (`pipeline.tied.OnEveryStage`)."""
    prefix = trunk.path + "."
    names = []
    for name, m in module.named_modules():
        if name == "" or prefix.startswith(name + "."):
            at = f"{name}." if name else ""
            names += [at + n for n, p in _compat.module_parameters(m).items() if p is not None]
    return tuple(names)


def default_probe(module: nn.Module) -> Callable[[], Any]:
    """How the probe calls the model: as the tensor-parallel plan probe does (`lightning_par.blocks._probe.probe_call`:
    ``example_input_array`` when the module has one, Lightning's convention, else one sequence of 8 token ids)."""
    return lambda: probe_call(module)


def find_ownership(module: nn.Module, trunk: Trunk, run: Optional[Callable[[], Any]] = None) -> Ownership:
    """Assign every module outside the trunk to the first stage, the last, or both (see the module docstring).

    Args:
        module: the whole model (its values do not matter, only what runs when).
        trunk: its trunk.
        run: runs the model's forward once (default: `default_probe`).

    Raises:
        PipelineError: a unit's parameters are used between trunk blocks, where no stage boundary can own them; or
            code after the trunk reads a tensor computed inside it other than the last block's output. (Reads that
            rule out only some cuts are returned in ``cut_conflicts``; the split avoids those cuts.)
    """
    units = outer_units(module, trunk)
    uses = probe_forward(module, trunk, units, run or default_probe(module))
    if isinstance(uses, str) and run is None:
        uses = _probe_holder(module, trunk, units, uses)
    if isinstance(uses, str):
        return dataclasses.replace(_by_registration(module, trunk, units, uses), sides=moe_loss_slots(module, trunk))
    if shown := out_of_order(uses.order):
        if trunk.repeated or set(uses.order) != set(range(len(trunk.blocks))):
            raise PipelineError(
                f"the forward calls the blocks of {trunk.path} in the order {shown}, and not the same way each time or "
                "not every block, while a pipeline cuts the trunk's calls in the order the probe saw them; train "
                "this model without pipeline parallelism (e.g. strategy='zero3')"
            )
        # A block runs more than once (ALBERT's one layer at every depth, a recurrent-depth loop): the pipeline cuts
        # the calls, and every stage holds the blocks that run more than once (`Ownership.everywhere`).
        return _of_calls(find_ownership(module, trunk.calls(uses.order), run), trunk.calls(uses.order), module)
    sides = side_slots(uses, trunk)
    for name, phases in uses.seen.items():
        if "trunk" in phases:
            raise PipelineError(
                f"{name} runs between the trunk's blocks ({trunk.path}), where the pipeline cuts, so no stage can own "
                "it; train this model without pipeline parallelism (pp=1, e.g. strategy='zero2'), or run that work "
                "inside the blocks or before / after the loop over them"
            )
    pre = [(n, m) for n, m in units if "pre" in uses.seen.get(n, {"pre"})]  # never used: the first stage keeps it
    post = [(n, m) for n, m in units if "post" in uses.seen.get(n, set())]
    conflicts = dict(uses.cuts.conflicts)
    reshaped = check_stand_ins(trunk, uses.calls, conflicts)
    # What a block returns besides the hidden state, and first-stage outputs, read past a stage boundary.
    carried = carried_slots(trunk, uses.cuts.returned_reads, uses.cuts.carried_reads, [n for n, _ in units])
    sides += moe_loss_slots(module, trunk) + carried
    return Ownership(pre, post, _tied(module, pre, post), "probe", sides=sides, cut_conflicts=conflicts,
                     reshaped=reshaped, everywhere=everywhere_params(module, trunk))  # fmt: skip


def _of_calls(own: Ownership, calls: Trunk, module: nn.Module) -> Ownership:
    # Values made inside a block and read after the trunk are replayed by block (`pipeline.sides`), one producer
    # per block: not for a block that runs more than once. A block's extra returns and first-stage outputs travel.
    if replayed := [s for s in own.sides if s.kind in ("output", "moe_loss")]:
        raise PipelineError(
            f"{replayed[0].name} makes a value that code after the trunk reads, in a trunk whose blocks run more than "
            f"once ({calls.path}); a pipeline carries such values only from blocks that run once. Train this model "
            "without pipeline parallelism (e.g. strategy='zero3'), or turn that output off in the model's config"
        )
    shared = tuple(f"{name}.{p}" for name, block in calls.repeated.items() for p, _ in block.named_parameters())
    held = {id(module.get_parameter(n)) for n in own.everywhere}
    shared = tuple(n for n in shared if id(module.get_parameter(n)) not in held)
    return dataclasses.replace(own, calls=calls, everywhere=own.everywhere + shared)


def _probe_holder(module: nn.Module, trunk: Trunk, units: Units, reason: str) -> Uses | str:
    # A LightningModule whose forward wants its batch (a dict, or no forward at all: the step calls `self.model`)
    # cannot be probed with token ids, but the model it wraps usually can: probe the outermost submodule holding
    # the trunk. Units outside that submodule never run in this probe; they keep registration order.
    holder = next((n for n, _ in module.named_children() if trunk.path.startswith(n + ".")), None)
    if holder is None:
        return reason
    uses = probe_forward(module, trunk, units, default_probe(module.get_submodule(holder)))
    if isinstance(uses, str):
        return f"{reason}; and the probe of {holder}: {uses}"
    order = [n for n, _ in module.named_modules()]
    for name, _ in units:
        if not name.startswith(holder + "."):
            uses.seen[name] = {"pre" if order.index(name) < order.index(holder) else "post"}
    return uses


def _by_registration(module: nn.Module, trunk: Trunk, units: Units, reason: str) -> Ownership:
    order = [n for n, _ in module.named_modules()]
    cut = order.index(trunk.path)
    pre = [(n, m) for n, m in units if order.index(n) < cut]
    post = [(n, m) for n, m in units if order.index(n) > cut]
    return Ownership(pre, post, _tied(module, pre, post), "registration order", reason,
                     everywhere=everywhere_params(module, trunk))


def _tied(module: nn.Module, pre: Units, post: Units) -> list[tuple[str, ...]]:
    pre_ids = {id(p) for _, m in pre for p in m.parameters()}
    post_ids = {id(p) for _, m in post for p in m.parameters()}
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in pre_ids and id(p) in post_ids:
            names.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names.values()]
