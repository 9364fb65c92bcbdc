"""The hooks of sequence parallelism (Korthikanti et al., arXiv 2205.05198) and of each region's replicated input.

Under sequence parallelism the residual stream between regions is split along dim 1: the first block's input is
scattered, each region's input gathered (all-gather) and its output reduce-scattered, the last block's output
gathered. A sequence length tp does not divide (a ViT's 16 patches + class token = 17) is padded at the end to the
next multiple of tp on the stream only: the regions see the true length (their input is cut back after the gather,
their output, split unevenly as ``torch.chunk`` does, is padded back), and the padded rows reach nothing but
position-wise code (norms, residual adds) whose output no region and no loss reads, so training is exact.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

_SEQ = 1  # batch-first models: (batch, sequence, hidden)


@dataclasses.dataclass
class SequenceState:
    """The true sequence length of the forward pass under way: set when the trunk is entered, or, on a pipeline
    stage after the first (whose input is the shard the stage before handed on), by the pipeline before each step
    (`PipelineRunner.shape_listeners`)."""

    length: int = 0
    warned: bool = False


def first_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: int) -> tuple[str | int, torch.Tensor]:
    """Where a region's hidden-state input is among its arguments (the first ``(..., hidden)`` tensor), and it."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-1] == hidden:
            return i, a
    named = [k for k in ("hidden_states", "x", "hidden", "input") if k in kwargs]
    for k in [*named, *kwargs]:
        a = kwargs[k]
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-1] == hidden:
            return k, a
    raise RuntimeError(f"no (batch, sequence, {hidden}) hidden-state argument found; pass tp_plan to fix the plan")


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int, value: Any) -> Any:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1 :]), kwargs
    return args, {**kwargs, where: value}


# Under sequence parallelism, a region's own all-gather: (this rank's sequence shard, the tp mesh, the true length)
# -> the whole sequence as a replicated DTensor whose backward reduce-scatters (fp8's: parallel/fp8/sequence.py).
Gather = Callable[[torch.Tensor, DeviceMesh, int], DTensor]


def region_input(
    mesh: DeviceMesh,
    state: SequenceState | None,
    hidden: int,
    mod: nn.Module,
    args: Any,
    kwargs: Any,
    gather: Gather | None = None,
) -> Any:
    """The region's hidden input as a replicated DTensor: its column-split projections then produce partial
    input gradients that are summed as DTensors and reduced once (all-reduce; reduce-scatter under SP, whose
    ``state`` is given; ``gather``: the region's own all-gather instead of DTensor's)."""
    where, x = first_hidden(args, kwargs, hidden)
    if isinstance(x, DTensor):
        return None
    full: Any
    if state is not None and not state.length <= x.shape[_SEQ] * mesh.size() < state.length + mesh.size():
        raise RuntimeError(
            f"a sequence shard of {x.shape[_SEQ]} rows reached {type(mod).__name__} while the sequence has "
            f"{state.length} tokens over tp={mesh.size()}; pass sequence_parallel=False"
        )
    if state is not None and gather is not None:
        full = gather(x, mesh, state.length)
    elif state is not None:
        full = DTensor.from_local(x, mesh, [Shard(_SEQ)], run_check=False).redistribute(mesh, [Replicate()])
        if full.shape[_SEQ] > state.length:
            full = full.narrow(_SEQ, 0, state.length)  # drop the stream's padding: the region sees the true length
    else:
        full = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    args, kwargs = _replace(args, kwargs, where, full)
    # The same hidden state passed again (CTRL's attention(v, k, q), one tensor three times) is the same input.
    return tuple(full if a is x else a for a in args), {k: full if v is x else v for k, v in kwargs.items()}


def pad_region_output(mesh: DeviceMesh, state: SequenceState, mod: nn.Module, args: Any, out: Any) -> Any:
    """A row-split output, reduce-scattered over the true length (``torch.chunk`` split: the last ranks short),
    padded at the end to this rank's slice of the padded stream."""
    per = -(-state.length // mesh.size())
    if isinstance(out, torch.Tensor) and out.shape[_SEQ] < per:
        pad = out.new_zeros((*out.shape[:_SEQ], per - out.shape[_SEQ], *out.shape[_SEQ + 1 :]))
        return torch.cat([out, pad], _SEQ)
    return None


def _first_tensor(args: Any, kwargs: Any) -> tuple[Any, Any]:
    return next(
        ((i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)),
        next(((k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)), (None, None)),
    )


def scatter_sequence(mesh: DeviceMesh, state: SequenceState, mod: nn.Module, args: Any, kwargs: Any) -> Any:
    """Entering the trunk: keep this rank's slice of the sequence (no communication; all-gather in backward)."""
    where, x = _first_tensor(args, kwargs)
    if x is None or where is None:
        raise RuntimeError("the first block got no tensor input to split along the sequence")
    tp, length = mesh.size(), int(x.shape[_SEQ])
    state.length = length
    if length % tp:
        if not state.warned and mesh.get_local_rank() == 0:
            warnings.warn(
                f"sequence length {length} is not a multiple of tp={tp}: sequence parallelism pads the residual "
                f"stream to {length + (-length) % tp} (attention and MLPs see the true {length}; exact); pass "
                "sequence_parallel=False to skip the padding",
                stacklevel=2,
            )
        state.warned = True
        pad = x.new_zeros((*x.shape[:_SEQ], (-length) % tp, *x.shape[_SEQ + 1 :]))
        x = torch.cat([x, pad], _SEQ)
    local = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(_SEQ)]).to_local()
    return _replace(args, kwargs, where, local)


def gather_sequence(mesh: DeviceMesh, state: SequenceState, mod: nn.Module, args: Any, out: Any) -> Any:
    """Leaving the trunk: all-gather the sequence so the code after it (final norm, head, loss) runs as written."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(t, mesh, [Shard(_SEQ)], run_check=False).redistribute(mesh, [Replicate()])
        return full.to_local().narrow(_SEQ, 0, state.length)

    if isinstance(out, torch.Tensor):
        return gather(out)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return type(out)([gather(out[0]), *out[1:]])  # a list too (OpenAI GPT's blocks return [hidden, ...])
    raise RuntimeError("the last block returned no tensor (or tuple starting with one) to gather along the sequence")


class WholeInRegion:
    """Hooks for a replicated module with parameters inside a split region that reads the region's input (Hugging
    Face RoBERTa-PreLayerNorm's ``intermediate.LayerNorm``, before ``intermediate.dense``): it gets that input as
    the gathered replicated DTensor, and its parameters are plain tensors. Every tp rank runs it on the whole local
    input, as one process does, so its parameters' gradients are the same on every rank and need no reduction; its
    output becomes a replicated DTensor again, whose ``Partial`` gradient from the column-split readers is
    all-reduced once there (instead of at the region's input)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.entered = mesh, False

    def before(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        whole = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor) and a.placements == (Replicate(),)]
        self.entered = bool(whole)
        if not whole:
            return None

        def local(a: Any) -> Any:
            return a.to_local() if any(a is w for w in whole) else a

        return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}

    def after(self, mod: nn.Module, args: Any, out: Any) -> Any:
        if not self.entered or not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            return None
        return DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
