"""PipeDream-2BW simulated in one process, for tests/test_two_bw.py (a `_worker.py` job with ``simulate_two_bw``).

The update rule of Narayanan et al., arXiv 2006.09503, section 3.1: ``W(t+1) = W(t) - lr * grad f_{t-1}(W(t-1))``,
a delay of one step on every stage. Step t's logged loss is the loss of its batch at ``W(t)`` (the forward the
pipeline runs in step t); its optimizer step applies the gradient of batch t-1 taken at ``W(t-1)`` (the version
that batch's forward used). Step 0 applies nothing (no gradient: the optimizer skips every parameter; the LR
scheduler still steps, as Lightning's loop does). Written from the paper, not from lightning_par's code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from _sim_data import loss_on, optimizer_and_scheduler, sampler_order
from jobs import Job


def _loss(model: Any, dataset: Any, rows: list[int], microbatches: int) -> torch.Tensor:
    """A data-parallel rank's loss as the pipeline computes it: the mean of its microbatches' losses (the model's own
    loss where its forward returns one, a Hugging Face MoE's with its load-balancing term; else the worker's)."""
    losses = []
    for part in _chunks(rows, microbatches):
        x = torch.stack([dataset[i][0] for i in part])
        out = model(x)
        losses.append(out.loss if hasattr(out, "loss") else loss_on(model, dataset, part))
    return torch.stack(losses).mean()


def _chunks(rows: list[int], m: int) -> list[list[int]]:
    size = len(rows) // m  # as split_microbatches: equal contiguous chunks along the batch
    return [rows[i * size : (i + 1) * size] for i in range(m)]


def simulate_two_bw(job: Job, make_model: Callable[[], Any]) -> dict[str, Any]:
    """Train as ``job.simulate_two_bw`` = {dp, microbatches (default 1)} says; returns the losses and the final
    parameters."""
    sim = job.simulate_two_bw or {}
    dp, m = sim["dp"], sim.get("microbatches", 1)
    steps, global_batch, seq_len = job.steps, job.global_batch, job.seq_len
    L.seed_everything(job.seed, verbose=False)
    model = make_model()
    optimizer, scheduler = optimizer_and_scheduler(model)
    dataset, order = sampler_order(seq_len, steps * global_batch)
    per_rank = global_batch // dp

    def rows(rank: int, step: int) -> list[int]:
        return order[rank::dp][step * per_rank : (step + 1) * per_rank]

    losses = []
    previous = None  # the model at W(t-1)
    for step in range(steps):
        with torch.no_grad():  # the logged loss: this step's batch at W(t), the mean over the data-parallel ranks
            losses.append(sum(float(_loss(model, dataset, rows(r, step), m)) for r in range(dp)) / dp)
        grads: dict[str, torch.Tensor] = {}
        if previous is not None:  # batch t-1 at W(t-1), each rank's gradient averaged over the ranks
            for r in range(dp):
                previous.zero_grad(set_to_none=True)
                (_loss(previous, dataset, rows(r, step - 1), m) / dp).backward()
                for n, p in previous.named_parameters():
                    if p.grad is not None:
                        grads[n] = grads[n] + p.grad if n in grads else p.grad.clone()
        previous = copy.deepcopy(model)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    named = model.named_parameters(remove_duplicate=False)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named}}
