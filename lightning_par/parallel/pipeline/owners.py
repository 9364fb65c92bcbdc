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

On a stage that does not own a unit, `pipeline.shadow.shadow` puts a meta-device copy of the unit's whole subtree
in its place.

The probe does not depend on the parameters' values, only on the order of calls; it runs without gradients, in
eval mode (no dropout) and with the RNG state restored.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.blocks._probe import eval_mode, out_of_order, probe_call, writes_in_place
from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.pipeline.cuts import CutRule
from lightning_par.parallel.pipeline.meta import check_stand_ins
from lightning_par.parallel.pipeline.slots import PipelineError, SideSlot, carried_slots, moe_loss_slots, side_slots

__all__ = ["Ownership", "PipelineError", "SideSlot", "find_ownership", "outer_units"]

Units = list[tuple[str, nn.Module]]


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


class _Uses(TorchFunctionMode):
    """Records which units' parameters each torch call reads, and in which phase (before / in / after the trunk).

    A use inside a unit's forward counts for that unit alone: a tied weight is read by the embedding before the
    trunk and by the head after it, and each of the two units is placed by its own calls.
    """

    def __init__(self, unit_of: dict[int, set[str]], trunk: Trunk) -> None:
        super().__init__()
        self.unit_of, self.phase = unit_of, "pre"
        self.cuts = CutRule(trunk.names)  # which cuts keep the one-process values
        self.seen: dict[str, set[str]] = {}
        self.running: list[str] = []
        # Side outputs: tensors computed inside the trunk (by the module named) and read after it, other than
        # what the last block returns. The pipeline hands on only the hidden state, so the last stage would not
        # have them (router logits collected for a load-balancing loss, every layer's hidden states).
        self.made: dict[int, tuple[Tensor, str]] = {}  # the tensors are held so that their ids stay unique
        self.handed_on: set[int] = set()
        self.makers: list[str] = []
        self.side: list[tuple[int, str, str]] = []  # (tensor id, producer, consumer)
        # The innermost module inside a block that returned each tensor: (block, path in it, leaf, output spec).
        self.returned_by: dict[int, tuple[int, str, int, Any]] = {}
        self.calls: dict[int, tuple[tuple, dict, Any]] = {}  # block -> its first call's (args, kwargs, output)
        self.order: list[int] = []  # the blocks, in the order the forward calls them
        self.paused = False  # the probe's own tensor work (`_record_inputs`), not the model's

    def mark(self, unit: str) -> None:
        self.seen.setdefault(unit, set()).add(self.phase)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = getattr(func, "__name__", str(func))
        # Reading an attribute that is not a tensor (shape, dtype, device) uses no values; `.T` does.
        if name != "__get__" or isinstance(out, Tensor):
            reads = [t for t in _compat.tree_flatten((args, kwargs or {}))[0] if isinstance(t, Tensor)]
            for t in reads:
                self._used(t, name)
            self._follow(name, args, reads, out)
        if self.phase == "trunk":
            for t in _compat.tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.made.setdefault(id(t), (t, self.makers[-1] if self.makers else "the trunk"))
        return out

    def _follow(self, name: str, args: Any, reads: list[Tensor], out: Any) -> None:
        outs = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, Tensor)]
        if args and isinstance(args[0], Tensor) and writes_in_place(name):
            outs.append(args[0])
        if self.phase == "post":  # side outputs are carried to the last stage (`_side_slots`)
            reads = [t for t in reads if not self.carried(t)]
        first_stage = self.phase == "pre" and (bool(self.running) or any(id(t) in self.unit_of for t in reads))
        where = self.running[-1] if self.running else self._where()
        self.cuts.op(name, reads, outs, where=where, first_stage=first_stage)

    def _where(self) -> str:
        cuts = self.cuts
        if cuts.inside is not None:
            return self.makers[-1] if self.makers else cuts.names[cuts.inside]
        if self.phase == "pre":
            return "the code before the trunk"
        if self.phase == "post":
            return "the code after the trunk"
        return f"the code between {cuts.names[cuts.position - 1]} and {cuts.names[cuts.position]}"

    def carried(self, t: Tensor) -> bool:
        """Whether ``t`` (read after the trunk) is a side output the stages carry: made inside the trunk, not handed
        on by the last block, and returned by a module inside a block (the module a stage replays)."""
        where = self.returned_by.get(id(t))
        return id(t) in self.made and id(t) not in self.handed_on and where is not None and where[1] != ""

    def _used(self, t: Tensor, by: str) -> None:
        holders = self.unit_of.get(id(t), ())
        inside = self.running[-1] if self.running and self.running[-1] in holders else None
        for unit in (inside,) if inside is not None else holders:
            self.mark(unit)
        if self.phase == "post" and self.carried(t):
            self.side.append((id(t), self.made[id(t)][1], by))

    def left(self, block: int, path: str, out: Any) -> None:
        """A module inside block ``block`` returned ``out`` (inner modules return first: the first record stays)."""
        self.makers.pop()
        if self.phase != "trunk":
            return
        leaves, spec = _compat.tree_flatten(out)
        for j, t in enumerate(leaves):
            if isinstance(t, Tensor) and id(t) in self.made:
                self.returned_by.setdefault(id(t), (block, path, j, spec))


def _leaver(uses: _Uses, block: int, path: str) -> Callable[..., None]:
    def leave(_m: nn.Module, _a: Any, out: Any) -> None:  # returning a value would replace the module's output
        uses.left(block, path, out)

    return leave


def _record_call(
    calls: dict[int, tuple[tuple, dict, Any]], i: int, _m: nn.Module, args: tuple, kwargs: dict, out: Any
) -> None:
    if i in calls and calls[i][2] is None:  # the inputs as the block got them (`_record_inputs`), then its output
        calls[i] = (*calls[i][:2], out)  # returns nothing: a forward hook's result would replace the output


def _record_inputs(uses: _Uses, i: int, _m: nn.Module, args: tuple, kwargs: dict) -> None:
    if i in uses.calls:
        return
    # An object the block changes in place (a key/value cache that Hugging Face T5 passes to every block even in
    # training) is kept as it was before the call: what a stand-in for the block is called with in a stage.
    plain = (Tensor, type(None), bool, int, float, str)
    if not all(isinstance(x, plain) for x in _compat.tree_flatten((args, kwargs))[0]):
        uses.paused = True  # the copy is the probe's, not the model's: no reads for the cut rule
        try:
            args, kwargs = copy.deepcopy((args, kwargs))
        except Exception:  # not copyable: as it is
            pass
        finally:
            uses.paused = False
    uses.calls[i] = (args, kwargs, None)


def _probe(module: nn.Module, trunk: Trunk, units: Units, run: Callable[[], Any]) -> _Uses | str:
    unit_of: dict[int, set[str]] = {}
    for name, m in units:
        for p in m.parameters():
            unit_of.setdefault(id(p), set()).add(name)
    uses = _Uses(unit_of, trunk)

    def enter(*_: Any) -> None:
        if uses.phase == "pre":
            uses.phase = "trunk"

    def leave(_m: nn.Module, _a: Any, out: Any) -> None:
        uses.phase = "post"
        uses.handed_on.update(id(t) for t in _compat.tree_flatten(out)[0] if isinstance(t, Tensor))

    handles = [trunk.blocks[0].register_forward_pre_hook(enter), trunk.blocks[-1].register_forward_hook(leave)]
    for i, block in enumerate(trunk.blocks):  # where each torch call runs, for the cut rule
        handles.append(block.register_forward_pre_hook(lambda _m, a, i=i: uses.cuts.enter(i, a)))
        handles.append(block.register_forward_pre_hook(lambda *_, i=i: uses.order.append(i)))  # type: ignore[func-returns-value]
        handles.append(block.register_forward_hook(lambda _m, _a, out, i=i: uses.cuts.leave(i, out)))
        # What each block was called with and returned: what a stage that does not run it must hand on.
        handles.append(block.register_forward_pre_hook(partial(_record_inputs, uses, i), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_record_call, uses.calls, i), with_kwargs=True))
    for i, (prefix, block) in enumerate(zip(trunk.names, trunk.blocks)):  # which module inside made each tensor
        for sub_name, sub in block.named_modules():
            where = f"{prefix}.{sub_name}" if sub_name else prefix
            handles.append(sub.register_forward_pre_hook(lambda *_, w=where: uses.makers.append(w)))
            handles.append(sub.register_forward_hook(_leaver(uses, i, sub_name)))

    def called(name: str) -> None:  # a unit called without touching its parameters still runs where it is called
        uses.mark(name)
        uses.running.append(name)

    def returned(name: str, _m: nn.Module, _a: Any, out: Any) -> None:
        uses.running.pop()
        if uses.phase == "pre":  # what a first-stage module returns can be carried to every stage
            uses.cuts.unit_output(name, out)

    for name, m in units:
        handles.append(m.register_forward_pre_hook(lambda *_, n=name: called(n)))
        handles.append(m.register_forward_hook(partial(returned, name)))
    device = next(module.parameters()).device
    try:
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with eval_mode(module), torch.no_grad(), rng, uses:
            run()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        for h in handles:
            h.remove()
    if uses.phase != "post":
        return "the forward did not run the trunk to its last block"
    return uses


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
    uses = _probe(module, trunk, units, run or default_probe(module))
    if isinstance(uses, str) and run is None:
        uses = _probe_holder(module, trunk, units, uses)
    if isinstance(uses, str):
        return dataclasses.replace(_by_registration(module, trunk, units, uses), sides=moe_loss_slots(module, trunk))
    if shown := out_of_order(uses.order):
        raise PipelineError(
            f"the forward calls the blocks of {trunk.path} in the order {shown}: a block runs again (a loop over "
            "part of the trunk, as in recurrent-depth models) or out of order, while a pipeline runs each block once, "
            "in order, on its stage; train this model without pipeline parallelism (e.g. strategy='zero3')"
        )
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


def _probe_holder(module: nn.Module, trunk: Trunk, units: Units, reason: str) -> _Uses | str:
    # A LightningModule whose forward wants its batch (a dict, or no forward at all: the step calls `self.model`)
    # cannot be probed with token ids, but the model it wraps usually can: probe the outermost submodule holding
    # the trunk. Units outside that submodule never run in this probe; they keep registration order.
    holder = next((n for n, _ in module.named_children() if trunk.path.startswith(n + ".")), None)
    if holder is None:
        return reason
    uses = _probe(module, trunk, units, default_probe(module.get_submodule(holder)))
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
