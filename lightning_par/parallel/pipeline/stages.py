"""Pipeline parallelism around code we did not write: cut the user's model at stage boundaries.

The route (docs/design.md, "Pipeline: run the user's code, cut at the stage boundary"): every rank of a pipeline
group loads the same batch, and a stage runs the user's own step function (``training_step``, ...) on a
microbatch with the model cut down to what the stage owns:

- trunk blocks another stage owns are pass-throughs (they hand their first argument on unchanged; a block that
  returns more, or another shape, hands on its meta-device forward's output as zeros: `meta.check_stand_ins`);
- the first block the stage owns swaps in the activation received from the previous stage;
- the last block it owns ends the stage by raising `_StageEnd` with its output, which the stage module returns
  to the schedule; only the last stage runs on to the head and the loss, as the user wrote them;
- modules that run before the trunk (embeddings) are owned by the first stage, those that run after it (final
  norm, head) by the last (`pipeline.owners.find_ownership` probes the forward to tell); elsewhere a meta-device
  copy stands in (`pipeline.standins.shadow`): before the trunk it returns zeros of the right shape (the value is
  discarded by the swap), so side inputs computed before the trunk (rotary tables, masks) are recomputed locally
  instead of sent;
- a parameter used on both sides (a tied embedding and head) lives on both end stages
  (`pipeline.tied.TiedWeights` sums its gradients).

Modules other stages own are replaced by their shadows, so a rank holds only its stages' parameters, under their
original names (checkpoints move between layouts). Nothing here imports Lightning: the step function is
any callable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.pipeline.cuts import refused_split
from lightning_par.parallel.pipeline.meta import MetaOutputs, meta_copy
from lightning_par.parallel.pipeline.owners import Ownership, PipelineError, find_ownership
from lightning_par.parallel.pipeline.sides import SideCarrier
from lightning_par.parallel.pipeline.standins import _PassThrough, _Walker, replace_module, shadow

__all__ = ["PipelineError", "PipelineModel", "StageModule", "StageSpec"]


class _StageEnd(BaseException):
    """Raised by a stage's last block to end the stage's run of the user's code.

    A `BaseException` so that a broad ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One pipeline stage.

    Args:
        index: stage index in the whole pipeline (``0 .. n_stages - 1``).
        start, end: its trunk blocks, ``range(start, end)``.
        is_first, is_last: whether it runs the code before / after the trunk.
    """

    index: int
    start: int
    end: int
    is_first: bool
    is_last: bool


@dataclasses.dataclass
class _Active:
    spec: Optional[StageSpec]  # None while probing the trunk's input
    incoming: Optional[Tensor]
    trunk_started: bool = False
    measuring: bool = False  # a shape pass: the stage ends at its last block, even the last stage
    walk: Optional[list[Tensor]] = None  # a walk (`PipelineModel.walk`): the hidden state entering each block
    calls: int = 0  # trunk calls so far in this run (a trunk of calls: `Ownership.calls`)


def _outside(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name} was called outside the pipeline: under pipeline parallelism the model runs only inside "
        "training_step / validation_step / test_step, which the strategy drives through the schedule"
    )


class StageModule(nn.Module):
    """The module `torch.distributed.pipelining.PipelineStage` drives for one stage.

    Its registered parameters are exactly the stage's own (the schedule's weight-gradient pass of the zero-bubble
    schedules walks them); the user's module is held unregistered.

    Args:
        owner: the cut model.
        spec: the stage.
        owned: the modules whose parameters this stage owns.
    """

    _owner: PipelineModel

    def __init__(
        self, owner: PipelineModel, spec: StageSpec, owned: Sequence[nn.Module], everywhere: Sequence[nn.Parameter] = ()
    ) -> None:
        super().__init__()
        self.owned = nn.ModuleList(owned)
        # Parameters every stage holds (`Ownership.everywhere`): the stage's own too, so that a zero-bubble schedule's
        # weight pass, which computes the gradients of the stage's parameters alone, computes theirs.
        self.everywhere = nn.ParameterList(everywhere)
        object.__setattr__(self, "_owner", owner)
        self.spec = spec

    def forward(self, *args: Tensor, mb: Tensor) -> Any:
        # args: the hidden state, then the trunk's side outputs made before this stage (pipeline.sides).
        owner = self._owner
        return owner.run_stage(self.spec, args[0] if args else None, int(mb.reshape(-1)[0]), args[1:],
                               measure=owner.measuring)  # fmt: skip


StepFn = Callable[[int, StageSpec], Optional[Tensor]]


class PipelineModel:
    """The user's module cut for the stages one rank runs (see the module docstring).

    Args:
        module: the user's module; changed in place.
        trunk: its trunk (`lightning_par.blocks.trunk.find_trunk`).
        ranges: block range of every stage of the pipeline (`lightning_par.parallel.pipeline.partition.partition`).
        local_stages: indices of the stages this rank runs.
        device: the rank's device.
        ownership: which stage owns each module outside the trunk (default: `find_ownership` probes the forward).
    """

    def __init__(
        self,
        module: nn.Module,
        trunk: Trunk,
        ranges: Sequence[tuple[int, int]],
        local_stages: Sequence[int],
        device: torch.device,
        ownership: Optional[Ownership] = None,
    ) -> None:
        own = ownership if ownership is not None else find_ownership(module, trunk)
        trunk = own.calls or trunk  # a block that runs more than once: one place per call
        if (why := refused_split(own.cut_conflicts, trunk.names, ranges)) is not None:
            raise PipelineError(why)
        self.module, self.trunk, self.device, self.ownership = module, trunk, device, own
        n = len(ranges)
        self.n_stages, self.ranges = n, list(ranges)
        self.specs = [StageSpec(s, *ranges[s], is_first=s == 0, is_last=s == n - 1) for s in sorted(local_stages)]
        self._active: Optional[_Active] = None
        self.step_fn: Optional[StepFn] = None  # this step's: `begin_step`
        self.hidden_dtype: Optional[torch.dtype] = None
        self.measuring = False  # stage calls are shape passes: `shape_pass`
        self._stage_modules: Optional[list[StageModule]] = None
        self.pre_names, self.post_names = [n for n, _ in own.pre], [n for n, _ in own.post]
        self.owns_first = any(s.is_first for s in self.specs)
        self.owns_last = any(s.is_last for s in self.specs)
        owned_idx = {i for s in self.specs for i in range(s.start, s.end)}
        self.blocks: dict[int, nn.Module] = {}
        # Blocks that run more than once stay on every rank, whichever stage runs each call (`Ownership.everywhere`
        # holds their parameters); their calls are told apart by counting (`_place`).
        self.shared = trunk.repeated
        passthroughs: dict[int, _PassThrough] = {}
        for i, (name, block) in enumerate(zip(trunk.names, trunk.blocks)):
            if i in owned_idx:
                self.blocks[i] = block
            elif name not in self.shared:
                passthroughs[i] = _PassThrough(self, i, name, block)
                replace_module(module, name, passthroughs[i])
        # Blocks that return more than a hidden state of their input's shape: a stage they run before hands on
        # what their meta-device forward returns (`meta.check_stand_ins`), made once per input signature; a
        # pass-through's own meta copy serves, else (a block of another of this rank's stages) one is made.
        self._stand_ins = {
            i: MetaOutputs(passthroughs[i]._original if i in passthroughs else meta_copy(trunk.blocks[i]), device)
            for i in own.reshaped
        }
        # Tensors modules inside the trunk return and code after it reads travel with the hidden state, and so do
        # what a boundary's last block returns besides it and first-stage outputs read later (`pipeline.slots`).
        bounds = {start - 1 for start, _ in ranges[1:]}
        slots = [s for s in own.sides if s.kind != "returned" or s.block in bounds]
        self.sides = SideCarrier(slots, trunk, owned_idx, dict(passthroughs)) if slots else None
        self.pre = dict(own.pre) if self.owns_first else {}
        self.post = dict(own.post) if self.owns_last else {}
        # A unit of both ends (an embedding used as the head) stays whole wherever either end runs.
        kept = set(self.pre) | set(self.post)
        for units, before in ((own.pre, True), (own.post, False)):
            for name, m in units:
                if name not in kept:
                    kept.add(name)
                    stand_in = shadow(m, name, before=before, device=device, why=own.why(before),
                                      in_trunk=self._in_trunk)  # fmt: skip
                    replace_module(module, name, stand_in)
        if self.sides is not None:
            self.sides.hook_first_stage(module)

    def running_span(self) -> Optional[tuple[int, int]]:
        """The trunk blocks ``range(start, end)`` the stage now running computes (``None`` outside a stage run):
        context parallelism cuts the sequence at ``start``, where the stage's received activation comes in."""
        active = self._active
        return (active.spec.start, active.spec.end) if active is not None and active.spec is not None else None

    def _in_trunk(self) -> bool:
        return self._active is not None and self._active.trunk_started

    @property
    def owned_blocks(self) -> list[nn.Module]:
        """The trunk blocks this rank holds, each once, in order (activation checkpointing and tensor parallelism
        go here): its stages' blocks and the blocks that run more than once."""
        return list(self.held().values())

    def held(self) -> dict[str, nn.Module]:
        """The trunk blocks this rank holds by name, each once: its stages' blocks in order, then the blocks that run
        more than once that none of its stages calls."""
        held = {self.trunk.names[i]: self.blocks[i] for i in sorted(self.blocks)}
        return {**held, **{n: b for n, b in self.shared.items() if n not in held}}

    def stage_modules(self) -> list[StageModule]:
        """One `StageModule` per local stage, in stage order (the same objects on every call: ZeRO-3 shards them)."""
        if self._stage_modules is not None:
            return self._stage_modules
        out = []
        for spec in self.specs:
            # A block that runs more than once is held by every stage with the parameters in `everywhere`.
            names = dict.fromkeys(n for n in self.trunk.names[spec.start : spec.end] if n not in self.shared)
            owned: list[nn.Module] = [self.module.get_submodule(n) for n in names]
            owned += list(self.pre.values()) if spec.is_first else []
            owned += list(self.post.values()) if spec.is_last else []
            everywhere = [self.module.get_parameter(n) for n in self.ownership.everywhere]
            out.append(StageModule(self, spec, owned, everywhere))
        self._stage_modules = out
        return out

    @contextlib.contextmanager
    def shape_pass(self) -> Iterator[None]:
        """Stage calls inside are shape passes (`pipeline.preflight`): each stage ends at its last block, even the
        last stage, and returns the side outputs it measured."""
        self.measuring = True
        try:
            yield
        finally:
            self.measuring = False

    def begin_step(self, step_fn: StepFn) -> None:
        """What this step's stages run on microbatch ``i`` as stage ``spec``: ``step_fn(i, spec)``."""
        self.step_fn = step_fn

    def install(self) -> None:
        """Route the owned blocks' forwards through the stage dispatch (after activation checkpointing wrapped
        them, so the swap and the stage end happen outside any recomputed region)."""
        places = {name: self.trunk.names.index(name) for name in self.held()}
        for name, block in self.held().items():
            forward = block.forward
            block.forward = (  # type: ignore[method-assign]
                lambda *a, _i=places[name], _f=forward, **k: self._block_call(_i, _f, a, k)
            )

    def install_probe_hooks(self) -> None:
        """Stop a probe at the trunk's entry before any other forward pre-hook of the block runs.

        Call after every wrapping that adds pre-hooks (FSDP2 prepends its unshard hook): a probe must not
        gather a block's parameters it will never use.
        """
        for block in self.held().values():
            block.register_forward_pre_hook(self._probe_hook, prepend=True)

    def _probe_hook(self, module: nn.Module, args: tuple) -> None:
        active = self._active
        if active is not None and active.spec is None and active.walk is None and args:
            raise _StageEnd(args[0])

    # ---- running ---------------------------------------------------------------------------------------------
    def _place(self, i: int, active: _Active) -> int:
        # Which call of the trunk this is, where a block runs more than once (block ``i``: one of its places).
        v = active.calls
        active.calls += 1
        names = self.trunk.names
        if v >= len(names) or names[v] != names[i]:
            seen = names[v] if v < len(names) else "no further block"
            raise PipelineError(
                f"the forward called {names[i]} as trunk call {v}, where the ownership probe saw {seen}: a trunk whose "
                "blocks run more than once must run them in the same order every forward"
            )
        return v

    def _block_call(self, i: int, forward: Optional[Callable[..., Any]], args: tuple, kwargs: dict) -> Any:
        name = self.trunk.names[i]
        active = self._active
        if active is None:
            raise _outside(name)
        if self.shared and (active.spec is not None or active.walk is not None):
            i = self._place(i, active)
        if not args:
            raise PipelineError(f"{name} was called without positional arguments; pass the hidden state first")
        if active.spec is None:
            if active.walk is None:  # probing: the hidden state entering the trunk
                raise _StageEnd(args[0])
            return self._walk_step(i, args, kwargs, active.walk)
        active.trunk_started = True
        spec = active.spec
        if i < spec.start:
            if self.sides is not None:
                self.sides.replay(i)  # the recorder's hooks see this block's side outputs, in the block's place
            # Its values are never read (the cut rule), only its structure, shapes and plain values (Swin's next
            # input dimensions); the hidden state is handed on as it is until the stage's first block swaps it.
            stand_in = self._stand_ins.get(i)
            out = args[0] if stand_in is None else stand_in(args, kwargs, keep=args[0])
            # The block before this stage: what it returned besides the hidden state, as received.
            return self.sides.returned(i, out) if self.sides is not None and i == spec.start - 1 else out
        if i >= spec.end or forward is None:
            raise PipelineError(f"{name} ran after stage {spec.index} ended; the trunk's blocks must run in order")
        if i == spec.start and active.incoming is not None:
            args = (active.incoming, *args[1:])
        out = forward(*args, **kwargs)
        if i == spec.end - 1 and (not spec.is_last or active.measuring):
            raise _StageEnd(out)
        return out

    def run_stage(
        self, spec: StageSpec, incoming: Optional[Tensor], mb: int, sides: Sequence[Tensor] = (), measure: bool = False
    ) -> Any:
        """Run the step function for microbatch ``mb`` as stage ``spec``; the stage's output (activation or loss).

        Args:
            spec: one of this rank's stages.
            incoming: the activation received from the previous stage (``None`` on the first stage).
            mb: microbatch index.
            sides: the trunk's side outputs received with it (`pipeline.sides`).
            measure: a shape pass: end at the stage's last block and return what `SideCarrier.measured` gives.
        """
        if self.step_fn is None:
            raise RuntimeError("run_stage needs step_fn (the pipeline runner's begin_step, each step)")
        self._active = _Active(spec, incoming, measuring=measure)
        carrying = self.sides.running(spec.start, spec.end, sides) if self.sides else contextlib.nullcontext()
        try:
            with carrying:
                try:
                    out = self.step_fn(mb, spec)
                except _StageEnd as end:
                    return self._stage_output(spec, end.output, measure)
        finally:
            self._active = None
        if not spec.is_last:
            raise PipelineError(
                f"stage {spec.index} finished without running block {self.trunk.names[spec.end - 1]}; the model's "
                "forward must call every trunk block, in order"
            )
        if out is None:  # evaluation steps may return nothing: the schedule still wants a tensor
            return torch.zeros((), device=self.device)
        return out

    def _stage_output(self, spec: StageSpec, output: Any, measure: bool) -> Any:
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(hidden, Tensor):
            raise PipelineError(
                f"block {self.trunk.names[spec.end - 1]} returned {type(hidden).__name__}; trunk blocks must "
                "return the hidden state (alone or first in a tuple)"
            )
        if self.sides is not None:
            self.sides.record_returned(spec.end - 1, output)
        if measure:
            return self.sides.measured() if self.sides is not None else {}
        # One dtype on the wire: the receiving stage allocated its buffer from the probed trunk input. Contiguous: a
        # send takes a dense buffer, and a block may return a permuted view (ConvNeXt's channels-last blocks);
        # `contiguous` is free for a tensor that already is, and a copy autograd follows otherwise.
        hidden = hidden.to(self.hidden_dtype) if self.hidden_dtype is not None else hidden
        sides = self.sides.outputs(spec.end, check=True) if self.sides is not None else []
        wire = [t.contiguous() if isinstance(t, Tensor) else t for t in (hidden, *sides)]
        return tuple(wire) if sides else wire[0]

    def walk(self, fn: Callable[[], Any]) -> list[Tensor]:
        """Run ``fn`` (the step function on a microbatch) with every trunk block stood in: the hidden state entering
        each block (zeros where a stand-in made them).

        Only for a trunk with blocks that change the hidden state's shape (`Ownership.reshaped`): what crosses each
        stage boundary then has a shape of its own. No block computes; stand-ins give the shapes."""
        seen: list[Tensor] = []
        self._active = _Active(None, None, walk=seen)
        # The owned blocks stood in too while walking: called, FSDP2's hooks on a block (ZeRO-3) would set it up as
        # a root of its own, and the stage's real root could not be set up after it.
        held = self.held()
        walkers = {name: _Walker(self, self.trunk.names.index(name), block) for name, block in held.items()}
        for name, walker in walkers.items():
            replace_module(self.module, name, walker)
        try:
            fn()
        except _StageEnd:
            return seen
        finally:
            self._active = None
            for name in walkers:
                replace_module(self.module, name, held[name])
        raise PipelineError(f"the step never ran the trunk {self.trunk.path} to its last block; nothing to pipeline")

    def _walk_step(self, i: int, args: tuple, kwargs: dict, seen: list[Tensor]) -> Any:
        seen.append(args[0])
        if i == len(self.trunk.names) - 1:
            raise _StageEnd(None)  # no stage boundary after the last block (the last stage sends its loss)
        stand_in = self._stand_ins.get(i)
        return args[0] if stand_in is None else stand_in(args, kwargs, keep=args[0])

    def probe(self, fn: Callable[[], Any]) -> Tensor:
        """Run ``fn`` (the step function on a microbatch) up to the trunk and return the trunk's input."""
        self._active = _Active(None, None)
        try:
            fn()
        except _StageEnd as end:
            return end.output
        finally:
            self._active = None
        raise PipelineError(f"the step never called the trunk {self.trunk.path}; nothing to pipeline")
