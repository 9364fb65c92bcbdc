"""PowerSGD simulated in one process, for tests/test_powersgd.py (a `_worker.py` job with ``simulate_powersgd``).

One model; at each step the ``dp`` data-parallel ranks' gradients are computed one after the other on the samples
each rank reads, and averaged the way PowerSGD averages them (Vogels et al., arXiv 1905.13727, Algorithm 1, with
error feedback and warm start): for each gradient matrix M_i (rank i's gradient plus its error, viewed as
``shape[0] x rest``), ``P = sum_i M_i Q`` orthonormalised, ``Q = mean_i M_i^T P``, the mean taken as ``P Q^T``;
rank i's error becomes ``M_i`` minus what it received. Matrices that would not shrink by more than 2x, and every
gradient of the first ``start`` steps, are averaged exactly. Written from the paper and torch's documented
conventions (the per-bucket error and warm start, the seeded draw of the first Q per bucket, grouped by shape),
not from lightning_par's code; the bucket layout is the run's (``stages``: per pipeline stage, the parameter names
per bucket and those averaged exactly).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
from _sim_data import loss_on, optimizer_and_scheduler, sampler_order
from jobs import Job


def _orthonormal(m: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``m`` (the span is what matters: P P^T is basis-free)."""
    return torch.linalg.qr(m).Q


def _matrix(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _compressed(shape: torch.Size, rank: int) -> bool:
    n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    return (n + m) * min(n, m, rank) * 2 < n * m


class _Simulated:
    """PowerSGD's state over ``dp`` simulated ranks: an error per rank and bucket, a warm-started Q per tensor."""

    def __init__(self, dp: int, rank: int, start: int, buckets: list[list[str]]) -> None:
        self.dp, self.rank, self.start, self.buckets = dp, rank, start, buckets
        self.rng = np.random.RandomState(0)
        self.errors: dict[int, list[torch.Tensor]] = {}
        self.qs: dict[str, torch.Tensor] = {}
        self.seeded: set[int] = set()
        self.step = 0

    def mean(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The gradient every rank receives for this state's buckets, from each rank's own."""
        if self.step < self.start:
            self.step += 1
            return {}
        out: dict[str, torch.Tensor] = {}
        for b, names in enumerate(self.buckets):
            if not names:
                continue  # every parameter of the bucket is averaged exactly: the hook never sees it
            errors = self.errors.setdefault(b, [torch.zeros(sum(grads[0][n].numel() for n in names))
                                                 for _ in range(self.dp)])  # fmt: skip
            sizes = [grads[0][n].numel() for n in names]
            ms = []  # per rank: gradient + error, per tensor
            for i in range(self.dp):
                flat = torch.cat([grads[i][n].reshape(-1) for n in names]) + errors[i]
                ms.append([t.view_as(grads[0][n]) for t, n in zip(torch.split(flat, sizes), names, strict=True)])
            compressed = [n for n in names if _compressed(grads[0][n].shape, self.rank)]
            if b not in self.seeded:
                # The first compressed step of this bucket: one seed per bucket (drawn even when it holds no matrix
                # to compress), then a Gaussian Q per matrix, the matrices taken shape by shape in order of first
                # appearance.
                self.seeded.add(b)
                seed = self.rng.randint(1_000_000_000)
                by_shape: dict[tuple[int, int], list[str]] = {}
                for n in compressed:
                    by_shape.setdefault(tuple(_matrix(grads[0][n]).shape), []).append(n)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    for (rows, cols), group in by_shape.items():
                        for n in group:
                            self.qs[n] = torch.randn(cols, min(rows, cols, self.rank))
            for j, n in enumerate(names):
                mats = [_matrix(ms[i][j]) for i in range(self.dp)]
                if n in compressed:
                    q = _orthonormal(self.qs[n])
                    p = _orthonormal(sum(m @ q for m in mats))
                    q = torch.stack([m.T @ p for m in mats]).mean(0)
                    self.qs[n] = q
                    out[n] = (p @ q.T).view_as(grads[0][n])
                else:
                    out[n] = torch.stack(mats).mean(0).view_as(grads[0][n])
            received = torch.cat([out[n].reshape(-1) for n in names])
            for i in range(self.dp):
                errors[i] = torch.cat([t.reshape(-1) for t in ms[i]]) - received
        self.step += 1
        return out


def simulate_powersgd(job: Job, make_model: Callable[[], Any]) -> dict[str, Any]:
    """Train as ``job.simulate_powersgd`` = {dp, rank, start, stages: [{buckets, exact}]} says; returns losses and
    parameters."""
    sim = job.simulate_powersgd or {}
    dp, steps, global_batch, seq_len = sim["dp"], job.steps, job.global_batch, job.seq_len
    L.seed_everything(job.seed, verbose=False)
    model = make_model()
    optimizer, _ = optimizer_and_scheduler(model)
    params = dict(model.named_parameters())
    # One state per pipeline stage (each compresses apart); a stage's always-exact parameters (a weight it holds a
    # copy of, as another stage does) and the names one process does not have (a tied weight's second copy) leave
    # its buckets: their mean is exact.
    states = [_Simulated(dp, sim["rank"], sim["start"], [[n for n in bucket if n in params and n not in stage["exact"]]
                                                         for bucket in stage["buckets"]])
              for stage in sim["stages"]]  # fmt: skip
    samples = steps * global_batch * job.accumulate  # as the worker's loader: global_batch per micro-batch
    dataset, order = sampler_order(seq_len, samples)
    # A step's micro-batches together: the mean of their equal-sized means is the mean over all their samples.
    per_rank = global_batch // dp * job.accumulate
    losses = []
    for step in range(steps):
        grads, rank_losses = [], []
        for rank in range(dp):
            model.zero_grad(set_to_none=True)
            loss = loss_on(model, dataset, order[rank::dp][step * per_rank : (step + 1) * per_rank])
            loss.backward()
            grads.append({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
            rank_losses.append(float(loss))
        means = {n: torch.stack([g[n] for g in grads]).mean(0) for n in grads[0]}
        for state in states:
            means.update(state.mean(grads))
        for n, g in means.items():
            params[n].grad = g
        optimizer.step()
        losses.append(sum(rank_losses) / dp)  # the logged loss: the mean over the data-parallel ranks
    # Every name of a tied weight, as the worker reports a run's (each end stage holds a copy under its name).
    named = model.named_parameters(remove_duplicate=False)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named}}
