"""Pipeline stages chained by hand in one process: each stage on its own deep copy of the model (its own "rank"),
each stage's output handed to the next as a schedule would, so that one backward from the last stage's loss reaches
every stage's parameters (tests/test_pipeline_units.py, tests/test_pipeline_calls.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.parallel.pipeline.stages import PipelineModel


def chain_stages(
    full: nn.Module, ranges: Sequence[tuple[int, int]], loss: Callable[[nn.Module], torch.Tensor]
) -> tuple[list[Any], list[nn.Module], list[PipelineModel]]:
    """Run ``loss`` (the user's step on one batch) through one stage per range: each stage's output (the hidden
    state, with what travels beside it as a tuple; the last, the loss), the stages' model copies, their cut models."""
    cuts = [copy.deepcopy(full) for _ in ranges]
    for m in cuts:
        m.zero_grad(set_to_none=True)
    outs: list[Any] = []
    pipes = []
    for s, m in enumerate(cuts):
        pipe = PipelineModel(m, find_trunk(m), ranges, [s], torch.device("cpu"))
        pipe.install()
        pipe.begin_step(lambda _mb, _spec, m=m: loss(m))
        out = outs[-1] if outs else None
        received = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        outs.append(pipe.run_stage(pipe.specs[0], received[0], 0, received[1]))
        pipes.append(pipe)
    return outs, cuts, pipes


def summed_grads(cuts: Sequence[nn.Module], tied: Sequence[tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the stages holding a copy (a tied weight on both end stages, under each
    name it has there; a block every stage holds), under its one-process name."""
    alias = {n: names[0] for names in tied for n in names}
    got: dict[str, torch.Tensor] = {}
    for m in cuts:
        for n, p in m.named_parameters():
            if p.grad is not None:
                n = alias.get(n, n)
                got[n] = got[n] + p.grad if n in got else p.grad
    return got
