"""PipeDream-2BW's runtime: a pipeline whose steps overlap, with two weight versions per stage.

Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (arXiv 2006.09503). A flushing schedule (1F1B)
drains the pipeline at every optimizer step: each rank idles ``p - 1`` stage times per step. 2BW keeps 1F1B's
steady state across the step boundary instead: stage ``s`` runs, for ``j = 0 .. m - 1``, the forward of this step's
microbatch ``j`` and then the backward of the microbatch ``p - 1 - s`` places earlier in the stream, so its first
``p - 1 - s`` backwards finish microbatches the previous step started. Only the forward ramp remains (the step ends
at a barrier: the last stage's loss is broadcast): ``(p - 1) f`` per step instead of ``(p - 1)(f + b)``
(`lightning_par.analysis.pipeline_timeline.two_bw_order` replays it).

The cost is the update rule: a step's gradient is applied one step late,
``W(t+1) = W(t) - lr * grad f_{t-1}(W(t-1))`` on every stage (the paper's delay of one; step 0 applies nothing),
and each stage keeps the version its in-flight microbatches used (weight stashing) until their backwards end:
two versions. The current version is the parameters themselves; at the end of a step, before the optimizer
writes them, the version in flight is copied once (`WeightVersion.freeze`): one extra copy of the stage's
trainable weights, on every stage but the last (whose backwards follow its forwards within the step). Gradients
of the two steps accumulate apart (one extra gradient buffer): the optimizer steps on the previous step's
complete gradient.

Mechanism: each step's forwards run the stage with its parameters swapped for leaves that alias their storage
(`WeightVersion.swapped`), so the autograd graph's weights are that version's leaves and their gradients collect
on them, not on the parameters; a saved-tensor hook files every saved view of those leaves by parameter and
offset, so that after `freeze` the backward reads the frozen copy. Recomputation (activation checkpointing) runs
inside the same swap during the backward, so it recomputes with the version the forward used.

Limits (refused in the config, `ParallelConfig`): one stage per rank; no tensor, context or expert parallelism,
ZeRO-3, compile or fp8 inside the stages (their parameters are DTensors or compiled graphs that the swap cannot
replace); ``microbatches >= pp``; no gradient accumulation. The last step's gradient is never applied (the
paper's pipeline ends the same way), and a resumed run restarts the stream: its first step applies nothing.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par import _compat
from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel
from lightning_par.parallel.pipeline.trace import StepTrace
from lightning_par.parallel.pipeline.two_bw.versions import WeightVersion

__all__ = ["TWO_BW", "TwoBW", "restore"]

TWO_BW = "two_bw"  # the key of a rank's 2BW stream (step count, pending gradient) in its own checkpoint file


def _metas(tensors: list[Tensor]) -> list[tuple[tuple, torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


class _Carried:
    """A resumed step's gradient, as a `WeightVersion` whose backwards all ran before the save."""

    def __init__(self, grads: list[Optional[Tensor]], params: list[nn.Parameter]) -> None:
        self._grads = [g.to(p.device) if g is not None else None for g, p in zip(grads, params)]

    def gradients(self) -> list[Optional[Tensor]]:
        return self._grads


class TwoBW:
    """Runs PipeDream-2BW training steps on one rank of a pipeline group (module docstring).

    Args:
        model: the cut model (one stage on this rank).
        group: the pipeline process group.
        trace: the runner's step trace (this runtime records its actions and waits there).
    """

    def __init__(self, model: PipelineModel, group: dist.ProcessGroup, trace: StepTrace) -> None:
        self.model, self.group, self.trace = model, group, trace
        (stage,) = model.stage_modules()  # one stage per rank
        self.stage, self.spec = stage, stage.spec
        trainable = {id(p) for p in stage.parameters() if p.requires_grad}
        self.holders = [(m, name, p) for m in model.module.modules() for name, p in _compat.module_parameters(m).items()
                        if p is not None and id(p) in trainable]  # fmt: skip
        self.params = list(dict.fromkeys(p for _, _, p in self.holders))
        self.pp = pp = dist.get_world_size(group)
        me = dist.get_rank(group)
        self.lag = pp - 1 - self.spec.index  # microbatches this stage's backwards trail its forwards by
        self.prev = dist.get_global_rank(group, me - 1) if me > 0 else None
        self.next = dist.get_global_rank(group, me + 1) if me < pp - 1 else None
        self.reset()

    def reset(self) -> None:
        """Forget the stream (a new fit, a loaded checkpoint): the next step starts it again and applies nothing."""
        self.step_index = 0
        self.versions: dict[int, WeightVersion] = {}
        self.inflight: dict[int, tuple[int, list[Tensor], list[Tensor]]] = {}  # microbatch -> (step, outs, ins)
        self.early: Optional[list[Tensor]] = None  # the next step's first backward's gradient, received at the end

    def stash_bytes(self) -> tuple[int, int]:
        """(bytes of weight copies held now, bytes of the stage's trainable weights): between steps one copy on
        every stage but the last, none there (the planner's `StateBytes.double_buffer` weight part)."""
        held = sum(t.numel() * t.element_size() for v in self.versions.values() for t in v.frozen or ())
        return held, sum(p.numel() * p.element_size() for p in self.params)

    # ---- one step ----------------------------------------------------------------------------------------------
    def step(self, mbs: list[Any], loss_fn: Callable[[Tensor], Tensor], metas: list[tuple[tuple, torch.dtype]]) -> None:
        """Forwards of this step's microbatches, backwards of the stream ``lag`` places behind; then the previous
        step's gradient lands in ``.grad`` (nothing on the first step).

        Args:
            mbs: this step's microbatches.
            loss_fn: what the last stage differentiates, from a microbatch's loss.
            metas: shape and dtype of each tensor this stage receives (the hidden state, then side outputs); the
                gradients it receives are shaped as what it sent with each microbatch (a short last batch too).
        """
        m = len(mbs)
        if m < self.pp:
            raise PipelineError(f"pp_schedule='2bw' needs microbatches >= pp={self.pp}; got {m}")
        t = self.step_index
        base = t * m
        self.versions[t] = WeightVersion(self.holders)
        sends: list[Any] = []
        for j in range(m):
            self._forward(t, base + j, j, loss_fn, metas, sends)
            n = base + j - self.lag
            if n in self.inflight:  # not yet run: before step 0's, or by a save's `flush`
                self._backward(n, sends, early=n == base - self.lag)
        if self.next is not None and self.lag > 0:  # the next step's first backward: the next stage's last one now
            self.early = self._recv(_metas(self.inflight[base + m - self.lag][1]), self.next, grads=True)
        start = time.perf_counter()
        for work in sends:
            work.wait()
        self.trace.add("wait", start, time.perf_counter())
        self._hand_over(t)
        self.step_index += 1

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Run the backwards still in flight (the last step's first microbatches' tail), in stream order: every
        rank of the pipeline group calls it together (a checkpoint's save). The gradient they complete is the one
        the next step applies anyway, computed on the same stashed weights, so the run continues unchanged."""
        sends: list[Any] = []
        for n in sorted(self.inflight):
            self._backward(n, sends, early=self.early is not None)
        for work in sends:
            work.wait()
        self.early = None

    def state_dict(self, names: dict[int, str]) -> dict[str, Any]:
        """What a checkpoint keeps of the stream, after `flush`: the step count and the last step's gradient (the
        next step's update), by parameter name (``names``: ``id(parameter)`` to its name). Copies: the save may
        write them in the background while the optimizer reduces the live ones."""
        self.flush()
        version = self.versions.get(self.step_index - 1)
        grads = version.gradients() if version is not None else [None] * len(self.params)
        return {
            "step": self.step_index,
            "gradients": {names[id(p)]: g.detach().clone() for p, g in zip(self.params, grads) if g is not None},
        }

    def load_state_dict(self, state: dict[str, Any], names: dict[int, str]) -> Optional[str]:
        """Continue the stream of a checkpoint's `state_dict`: its gradient is applied by the next step. Returns
        why it cannot (another stage's parameters: a changed layout), leaving the stream to start afresh."""
        self.reset()
        grads = state["gradients"]
        mine = [names[id(p)] for p in self.params]
        if not set(grads) <= set(mine):
            return f"it holds the gradient of other parameters ({sorted(set(grads) - set(mine))[:3]}...)"
        carried = _Carried([grads.get(n) for n in mine], self.params)
        self.step_index = state["step"]
        self.versions[self.step_index - 1] = carried  # type: ignore[assignment]
        return None

    def _hand_over(self, t: int) -> None:
        # Step t-1 is complete on this stage: its gradient goes to .grad for the optimizer. Step t's first backwards
        # (its gradient so far) stay on its version until the next call.
        previous = self.versions.pop(t - 1, None)
        for p, g in zip(self.params, previous.gradients() if previous is not None else [None] * len(self.params)):
            p.grad = g
        if any(step == t for step, _, _ in self.inflight.values()):  # the last stage ends its microbatches here
            self.versions[t].freeze()  # after the previous version is gone: two versions at most

    def _forward(self, t: int, n: int, j: int, loss_fn: Callable[[Tensor], Tensor],
                 metas: list[tuple[tuple, torch.dtype]], sends: list[Any]) -> None:  # fmt: skip
        trace = self.trace
        ins = self._recv(metas, self.prev, grads=False) if self.prev is not None else []
        start = time.perf_counter()
        with self.versions[t].swapped():
            out = self.stage(*ins, mb=torch.tensor([j], device=self.model.device))
            outs = [loss_fn(out)] if self.spec.is_last else (list(out) if isinstance(out, tuple) else [out])
        trace.add("F", start, time.perf_counter(), self.spec.index, n)
        if self.next is not None:
            sends += [dist.isend(o.detach(), dst=self.next, group=self.group) for o in outs]
        self.inflight[n] = (t, outs, ins)

    def _backward(self, n: int, sends: list[Any], early: bool) -> None:
        t, outs, ins = self.inflight.pop(n)
        pairs: list[tuple[Tensor, Optional[Tensor]]]
        if self.next is None:
            pairs = [(outs[0], None)]
        else:
            if early and self.early is not None:  # received at the end of the previous step
                grads, self.early = self.early, None
            else:
                grads = self._recv(_metas(outs), self.next, grads=True)
            floating = [o for o in outs if o.dtype.is_floating_point]  # what the next stage sends gradients for
            pairs = [(o, g) for o, g in zip(floating, grads) if o.requires_grad]
        start = time.perf_counter()
        if pairs:
            with self.versions[t].swapped():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.trace.add("B", start, time.perf_counter(), self.spec.index, n)
        if self.prev is not None:
            for x in ins:
                if x.dtype.is_floating_point:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(dist.isend(g, dst=self.prev, group=self.group))

    def _recv(self, metas: list[tuple[tuple, torch.dtype]], src: int, grads: bool) -> list[Tensor]:
        """Receive the tensors of ``metas`` from ``src`` (gradients: the floating ones only, in order)."""
        device = self.model.device
        out = []
        start = time.perf_counter()
        for shape, dtype in metas:
            if grads and not dtype.is_floating_point:
                continue
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src, group=self.group)
            out.append(buf.requires_grad_(not grads and dtype.is_floating_point))
        self.trace.add("wait", start, time.perf_counter())
        return out


def restore(two_bw: Optional[TwoBW], saved: Optional[dict[str, Any]], path: Any, module: nn.Module) -> None:
    """Resume ``two_bw``'s stream from this rank's ``saved`` state of checkpoint ``path`` (`TwoBW.state_dict`), or
    say, once, why the run does not continue as an uninterrupted one would."""
    names = {id(p): n for n, p in module.named_parameters()}
    why = None
    if two_bw is None:
        if saved is not None and saved["gradients"]:
            why = ("it was saved by a pp_schedule='2bw' run, whose last step's gradient (applied one step late) this "
                   "run's schedule does not apply")  # fmt: skip
    elif saved is None:
        why = ("it holds no 2BW stream for this rank (saved by another schedule, or by another number of ranks): the "
               "stream starts afresh and its first step applies no update")  # fmt: skip
    else:
        failed = two_bw.load_state_dict(saved, names)
        why = f"{failed}: the stream starts afresh and its first step applies no update" if failed else None
    if why and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"checkpoint {path}: {why}, so the run continues differently from an uninterrupted one",
                      stacklevel=2)  # fmt: skip
