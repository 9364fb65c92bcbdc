"""Local SGD / DiLoCo simulated in one process, for tests/test_local_sgd.py (a `_worker.py` job with ``simulate``).

``replicas`` copies of the model, each with its own optimizer (and LR scheduler), each trained on the samples its
data-parallel ranks would read; every ``every`` steps the outer loop of DiLoCo (arXiv 2311.08105, Algorithm 1):
the mean over replicas of ``theta - theta_replica`` is the outer gradient of an SGD step with Nesterov momentum on
``theta``, and every replica continues from ``theta``. Written from the paper, not from lightning_par's code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from _sim_data import loss_on, optimizer_and_scheduler, sampler_order
from jobs import Job


def simulate(job: Job, make_model: Callable[[], Any]) -> dict[str, Any]:
    """Train as ``job.simulate`` = {replicas, shards, every, lr, momentum} says; returns losses and replica 0's
    parameters."""
    sim = job.simulate
    replicas, shards, every = sim["replicas"], sim["shards"], sim["every"]
    dp = replicas * shards
    steps, global_batch, seq_len = job.steps, job.global_batch, job.seq_len
    L.seed_everything(job.seed, verbose=False)
    base = make_model()
    models = [copy.deepcopy(base) for _ in range(replicas)]
    optimizers, schedulers = zip(*(optimizer_and_scheduler(model) for model in models), strict=True)
    theta = [p.detach().clone().requires_grad_(True) for p in base.parameters()]
    outer = torch.optim.SGD(theta, lr=sim["lr"], momentum=sim["momentum"], nesterov=sim["momentum"] > 0)
    dataset, order = sampler_order(seq_len, steps * global_batch)
    per_rank = global_batch // dp
    losses = []
    for step in range(steps):
        step_losses = []
        for r, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            rank_losses = []
            for s in range(shards):  # the replica's ranks average their gradients: the mean of their mean losses
                rank = r * shards + s
                rows = order[rank::dp][step * per_rank : (step + 1) * per_rank]
                rank_losses.append(loss_on(model, dataset, rows))
            loss = torch.stack(rank_losses).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if schedulers[r] is not None:
                schedulers[r].step()
            step_losses.append(float(loss))
        losses.append(sum(step_losses) / replicas)  # the logged loss: the mean over every data-parallel rank
        if (step + 1) % every == 0:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    t.grad = torch.stack([t - list(m.parameters())[i] for m in models]).mean(0)
                outer.step()
                for model in models:
                    for p, t in zip(model.parameters(), theta, strict=True):
                        p.copy_(t)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in models[0].named_parameters()}}
