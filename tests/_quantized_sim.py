"""ZeRO-3's int8 weight all-gather (``zero_quantized_weights``) simulated in one process, for
tests/test_quantized_all_gather.py (a `_worker.py` job with ``simulate_quantized``).

One model trained on the whole global batch. Before each step's forward, every weight is replaced by what the
ranks would compute with: for each FSDP unit and each of the ``world`` ranks, that rank's shards of the unit's
parameters (``ceil(rows / world)`` rows each, zero-padded, one after another) are cut into blocks of 256, each
block scaled by its largest magnitude over 127 and rounded to int8 (half to even), and read back (ZeRO++'s qwZ,
arXiv 2306.10209, section 3.1). The gradient with respect to those values updates the full-precision weights
(straight-through). Written from the paper and FSDP2's documented shard layout, not from lightning_par's code; the
units (parameter names per unit, in all-gather order) are the run's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _sim_data import loss_on, optimizer_and_scheduler, sampler_order
from jobs import Job

BLOCK = 256


def _fake_quantized(params: dict[str, torch.Tensor], units: list[list[str]], world: int) -> dict[str, torch.Tensor]:
    out = {}
    for unit in units:
        shards = {n: torch.tensor_split(_padded(params[n], world), world) for n in unit}
        read = {n: [] for n in unit}  # type: dict[str, list[torch.Tensor]]
        for r in range(world):
            flat = torch.cat([shards[n][r].reshape(-1) for n in unit])
            x = F.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
            scale = x.abs().amax(dim=1, keepdim=True) / 127
            codes = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-127, 127)
            values = (codes * scale).view(-1)[: flat.numel()]
            for n, piece in zip(unit, torch.split(values, [shards[n][r].numel() for n in unit]), strict=True):
                read[n].append(piece.view_as(shards[n][r]))
        for n in unit:
            out[n] = torch.cat(read[n])[: params[n].shape[0]]
    return out


def _padded(t: torch.Tensor, world: int) -> torch.Tensor:
    rows = math.ceil(t.shape[0] / world) * world
    return torch.cat([t.detach(), t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def simulate_quantized(job: Job, make_model: Callable[[], Any]) -> dict[str, Any]:
    """Train as ``job.simulate_quantized`` = {world, units} says; returns losses and parameters."""
    sim = job.simulate_quantized or {}
    world, units = sim["world"], sim["units"]
    L.seed_everything(job.seed, verbose=False)
    model = make_model()
    optimizer, _ = optimizer_and_scheduler(model)
    params = dict(model.named_parameters())
    # A tied weight's other names: under a pipeline each end stage gathers (and quantizes) its own copy in units of
    # its own, so each use computes with its own values; the step sums both uses' gradients into the one weight.
    first = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n not in params}
    dataset, order = sampler_order(job.seq_len, job.steps * job.global_batch)  # step k's global batch: k*B:(k+1)*B
    losses = []
    for step in range(job.steps):
        rows = order[step * job.global_batch : (step + 1) * job.global_batch]
        exact = {n: p.detach().clone() for n, p in params.items()}
        every = {**params, **{a: params[n] for a, n in aliases.items()}}
        copies = {}
        with torch.no_grad():
            for n, value in _fake_quantized(every, units, world).items():
                if n in aliases:  # a separate tensor for this use, for the forward
                    copies[n] = torch.nn.Parameter(value.clone())
                    owner, _, attr = n.rpartition(".")
                    model.get_submodule(owner)._parameters[attr] = copies[n]
                else:
                    params[n].copy_(value)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_on(model, dataset, rows)
        loss.backward()
        with torch.no_grad():
            for n, copy in copies.items():  # the tie back, both uses' gradients in the one weight
                owner, _, attr = n.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = params[aliases[n]]
                params[aliases[n]].grad += copy.grad
            for n, p in params.items():
                p.copy_(exact[n])  # the step updates the full-precision weights with the quantized ones' gradient
        optimizer.step()
        losses.append(float(loss))
    named = model.named_parameters(remove_duplicate=False)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named}}
