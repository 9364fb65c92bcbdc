"""Pipeline bubble fraction per schedule against theory, activations in flight, and pipelined throughput.

Launch with p ranks (p = 2 or 4), one thread each:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_pipeline_bubble.py [--quick]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline_bubble.py [--quick]

1. Bubble: stages whose compute is a calibrated sleep (forward F, input-gradient B and weight-gradient W of
   ``--f-ms`` each, the zero-bubble paper's F = B = W, arXiv 2401.10241), driven by torch's schedules through
   `lightning_par.parallel.pipeline_schedule.SCHEDULES`. Sleeping stages measure the schedule, not this 2-core
   machine's contention. Each rank does m x (F + B + W) of work per step whatever the schedule (a rank's virtual
   stages split it); measured bubble = 1 - (time this rank spent in that work, as measured around each sleep) /
   step time, averaged over ranks: sleep overshoot under load counts as work, communication and Python
   overhead as bubble. Theory: (p-1)/(m+p-1) for GPipe and
   1F1B (Huang et al. arXiv 1811.06965; Narayanan et al. arXiv 2104.04473), (p-1)/(v m + p-1) for interleaved
   1F1B and looped BFS with v stages per rank; the zero-bubble schedules aim at ~0 (no ratio printed).
2. Peak in-flight microbatches on the first stage (activations held for backward): m for GPipe, <= p for 1F1B.
3. Throughput (p = 2 only): a real GPT step (forward + backward) pipelined over 2 ranks against the same model
   and batch on rank 0 alone, as a ratio of samples per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

from lightning_par.parallel.pipeline_schedule import SCHEDULES, local_stages, n_stages  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

BUSY = [0.0]  # seconds this rank spent in its stages' work (sleeps), as measured, not as requested


def _work(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    BUSY[0] += time.perf_counter() - start


class _Input(torch.autograd.Function):
    """Forward sleeps F; backward (the input gradient, B) sleeps B."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, f: float, b: float, counter: list[int]) -> Tensor:  # type: ignore[override]
        _work(f)
        counter[0] += 1
        counter[1] = max(counter[1], counter[0])
        ctx.b, ctx.counter = b, counter
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _work(ctx.b)
        ctx.counter[0] -= 1
        return g.contiguous(), None, None, None  # sent to the previous stage: must be dense


class _Weight(torch.autograd.Function):
    """The weight's contribution; its backward (W) sleeps W. Zero-bubble schedules run it separately from B."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, t: float) -> Tensor:  # type: ignore[override]
        ctx.t = t
        return w.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _work(ctx.t)
        return g, None


class SleepStage(nn.Module):
    """A stage with F, B and W of ``t`` seconds each; ``counter`` = [in flight now, peak]."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.zeros(()))
        self.counter = [0, 0]

    def forward(self, x: Tensor) -> Tensor:
        if not x.requires_grad:  # the first stage's input is data: make autograd run B there too
            x = x.detach().requires_grad_()
        return _Input.apply(x, self.t, self.t, self.counter) + _Weight.apply(self.w, self.t)


def _theory(name: str, p: int, m: int, v: int) -> float | None:
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name in ("interleaved_1f1b", "looped_bfs"):
        # Fill and drain cross p - 1 ranks at 1/v of a rank's per-microbatch work each.
        return (p - 1) / (v * m + p - 1)
    return None  # zero-bubble schedules: no closed form for torch's orders; they aim at ~0


def bubble(name: str, m: int, f: float, steps: int) -> tuple[float, float, int]:
    """Median step time of schedule ``name`` with ``m`` microbatches, its idle fraction (1 - measured work / step
    time, averaged over ranks and steps), and the first stage's peak microbatches in flight."""
    p, rank = dist.get_world_size(), dist.get_rank()
    info = SCHEDULES[name]
    v = info.virtual
    stages, modules = [], []
    for s in local_stages(name, p, rank):
        mod = SleepStage(f / v)
        modules.append(mod)
        meta = torch.empty(1, 4, device="meta", requires_grad=True)
        stages.append(PipelineStage(mod, s, n_stages(name, p), torch.device("cpu"), input_args=(meta,),
                                    output_args=meta, group=dist.group.WORLD))  # fmt: skip
    loss_fn = lambda out, _t: out.sum()  # noqa: E731
    sched = info.cls(stages[0], m, loss_fn=loss_fn) if v == 1 else info.cls(stages, m, loss_fn=loss_fn)
    x, target = torch.ones(m, 4), torch.zeros(m, 4)
    times, idle = [], []
    for i in range(steps + 1):
        dist.barrier()
        BUSY[0] = 0.0
        start = time.perf_counter()
        if any(s.is_first for s in stages):
            sched.step(x, target=target, return_outputs=False)
        else:
            sched.step(target=target, return_outputs=False)
        dist.barrier()
        if i:  # the first step also initialises the stages
            times.append(time.perf_counter() - start)
            idle.append(1 - BUSY[0] / times[-1])
    frac = torch.tensor(statistics.mean(idle))
    dist.all_reduce(frac)
    first = next((mod for mod, s in zip(modules, stages) if s.is_first), None)
    return statistics.median(times), float(frac) / dist.get_world_size(), first.counter[1] if first else -1


def throughput(steps: int, rounds: int) -> list[float]:
    """Per round: samples/s of a pipelined GPT step on 2 ranks over samples/s of the same step on rank 0 alone.

    Rounds alternate the two measurements seconds apart, so load that drifts on this shared machine hits both.
    """
    from lightning_par.models import GPT
    from lightning_par.parallel.pipeline_schedule import apply_pipeline
    from lightning_par.plans.trunk import find_trunk

    def make() -> GPT:
        torch.manual_seed(0)
        return GPT(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)

    batch = (torch.randint(0, 256, (16, 128)), torch.randint(0, 256, (16, 128)))
    full = make() if dist.get_rank() == 0 else None
    model = make()
    trunk = find_trunk(model)
    assert trunk is not None
    world = dist.group.WORLD
    assert world is not None
    runner = apply_pipeline(model, trunk, schedule="1f1b", pp=2, pp_rank=dist.get_rank(), group=world,
                            microbatches=4, device=torch.device("cpu"))  # fmt: skip
    runner.model.install()
    step_fn = lambda mb, _spec: model._loss(model(mb[0]), mb[1])  # noqa: E731
    ratios = []
    for _ in range(rounds):
        single = torch.tensor(0.0)
        if full is not None:
            ts = []
            for i in range(steps + 1):
                start = time.perf_counter()
                full._loss(full(batch[0]), batch[1]).backward()
                if i:
                    ts.append(time.perf_counter() - start)
            single = torch.tensor(statistics.median(ts))
        dist.barrier()
        ts = []
        for i in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            runner.train_step(batch, step_fn, lambda loss: loss / 4)
            dist.barrier()
            if i:
                ts.append(time.perf_counter() - start)
        dist.broadcast(single, src=0)
        ratios.append(float(single) / statistics.median(ts))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--f-ms", type=float, default=30.0, help="F = B = W per microbatch per rank, in ms")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="m in {p, 2p} only, 1 step")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the throughput comparison")
    parser.add_argument("--skip-bubble", action="store_true", help="only the throughput comparison (p = 2)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    f = args.f_ms / 1000
    steps = 1 if args.quick else args.steps
    rows = []
    for name in () if args.skip_bubble else SCHEDULES:
        for k in (1, 2) if args.quick else (1, 2, 4, 8):
            m = k * p
            if (name == "dualpipev" and m < 2 * p) or (name == "1f1b" and m < p):
                continue
            t, measured, peak = bubble(name, m, f, steps)
            theory = _theory(name, p, m, SCHEDULES[name].virtual)
            rows.append((name, m, t, measured, theory, peak))
    if rank == 0 and rows:
        print(f"\n## Bubble, p = {p}, F = B = W = {args.f_ms} ms per microbatch per rank\n")
        print("| schedule | m | step (ms) | bubble measured | bubble theory | measured / theory | peak in flight |")
        print("|---|---|---|---|---|---|---|")
        for name, m, t, measured, theory, peak in rows:
            th = f"{theory:.3f}" if theory is not None else "~0"
            ratio = f"{measured / theory:.2f}" if theory else "-"
            print(f"| {name} | {m} | {t * 1000:.0f} | {measured:.3f} | {th} | {ratio} | {peak} |")
    if p == 2:
        ratios = throughput(steps, args.rounds)
        if rank == 0:
            each = ", ".join(f"{r:.2f}" for r in ratios)
            print(
                f"\nGPT (4 x 256, seq 128, batch 16) samples/s, pipe on 2 ranks (1f1b, m=4) / 1 rank: median "
                f"{statistics.median(ratios):.2f} (rounds: {each}; ideal 2 x (1 - bubble 0.2) = 1.6)"
            )
    clean_exit()


if __name__ == "__main__":
    main()
