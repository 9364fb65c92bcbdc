"""Pipeline bubble fraction per schedule against theory, activations in flight, and pipelined throughput.

Launch with p ranks (p = 2 or 4), one thread each:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_pipeline_bubble.py [--quick]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_pipeline_bubble.py [--quick]
    ... --schedules interleaved_1f1b looped_bfs interleaved_zb --vpp 3 4 --skip-throughput   (stages per rank)

1. Bubble: stages whose compute is a calibrated sleep (forward F, input-gradient B and weight-gradient W of
   ``--f-ms`` each, the zero-bubble paper's F = B = W, arXiv 2401.10241), driven by torch's schedules through
   `lightning_par.parallel.pipeline.schedule.SCHEDULES`. Sleeping stages measure the schedule, not this 2-core
   machine's contention. The bubble is the time a rank sits waiting on its peers (inside the schedule's
   point-to-point waits, before its first action and after its last) over the step time, averaged over ranks;
   the median over steps.
   Theory: the schedule's own action table replayed with F = B = W and free communication
   (`lightning_par.analysis.pipeline_timeline`), which is (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. arXiv
   1811.06965; Narayanan et al. arXiv 2104.04473) and (p-1)/(v m + p-1) for interleaved 1F1B with v stages per
   rank (both printed as a check), and the exact figure for the zero-bubble and DualPipeV orders torch runs.
   Also printed: the host overhead per action (Python, gloo sends; 1 - (sleeps + waits) / step spread over the
   rank's actions), which the theory does not model and which the bubble above does not contain.
2. Peak in-flight microbatches on the first stage (activations held for backward): m for GPipe, <= p for 1F1B.
3. Throughput (p = 2 only): a real GPT step (forward + backward) pipelined over 2 ranks against the same model
   and batch on rank 0 alone, as a ratio of samples per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402

from lightning_par import _compat  # noqa: E402
from lightning_par.analysis.pipeline_timeline import compute_actions, one_f_one_b_order, replay  # noqa: E402
from lightning_par.parallel.pipeline.schedule import SCHEDULES, local_stages, n_stages, stages_per_rank  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

BUSY = [0.0]  # seconds this rank spent in its stages' work (sleeps), as measured, not as requested
WAIT = [0.0]  # seconds this rank spent blocked on point-to-point transfers from its peers
_torch_wait = _compat.pipeline_p2p_wait()


def _timed_wait(work: list[Any]) -> None:
    # Every schedule in torch waits on its receives (and sends) through this one function: the time inside it is
    # the rank idling on its peers, which is what a pipeline bubble is.
    start = time.perf_counter()
    _torch_wait(work)
    WAIT[0] += time.perf_counter() - start


_compat.set_pipeline_p2p_wait(_timed_wait)


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


def _closed_form(name: str, p: int, m: int, v: int) -> float | None:
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name in ("interleaved_1f1b", "looped_bfs"):
        # Fill and drain cross p - 1 ranks at 1/v of a rank's per-microbatch work each.
        return (p - 1) / (v * m + p - 1)
    return None  # zero-bubble schedules: the replayed table is the reference


@dataclasses.dataclass
class Row:
    name: str
    m: int
    step: float  # median step time, seconds
    idle: float  # measured bubble: waiting on peers / step time
    theory: float  # replayed action table
    closed: float | None  # textbook formula, where there is one
    overhead_ms: float  # host time per action not in stage work and not waiting
    peak: int  # first stage's peak microbatches in flight


def bubble(name: str, m: int, f: float, steps: int, vpp: int | None = None) -> Row:
    """Run schedule ``name`` with ``m`` microbatches ``steps`` times (after one warm-up step) and measure it;
    ``vpp``: stages per rank of a looped interleaved schedule (`ParallelStrategy(vpp=...)`)."""
    p, rank = dist.get_world_size(), dist.get_rank()
    info = SCHEDULES[name]
    v = stages_per_rank(name, vpp)
    stages, modules = [], []
    for s in local_stages(name, p, rank, vpp):
        mod = SleepStage(f / v)
        modules.append(mod)
        meta = torch.empty(1, 4, device="meta", requires_grad=True)
        stages.append(PipelineStage(mod, s, n_stages(name, p, vpp), torch.device("cpu"), input_args=(meta,),
                                    output_args=meta, group=dist.group.WORLD))  # fmt: skip
    loss_fn = lambda out, _t: out.sum()  # noqa: E731
    sched = info.cls(stages[0], m, loss_fn=loss_fn) if v == 1 else info.cls(stages, m, loss_fn=loss_fn)
    # Schedule1F1B's own table is descriptive only (and misnumbers the last stage): replay the order it runs.
    table = one_f_one_b_order(p, m) if name == "1f1b" else _compat.pipeline_order(sched)
    theory = replay(table, f / v, f / v, f / v).bubble
    n_actions = len(compute_actions(table)[rank])
    x, target = torch.ones(m, 4), torch.zeros(m, 4)
    times, idle, overhead = [], [], []
    for i in range(steps + 1):
        dist.barrier()
        BUSY[0] = WAIT[0] = 0.0
        start = time.perf_counter()
        if any(s.is_first for s in stages):
            sched.step(x, target=target, return_outputs=False)
        else:
            sched.step(target=target, return_outputs=False)
        done = time.perf_counter()
        # perf_counter is the system-wide monotonic clock, so the ranks' timestamps compare directly: the step runs
        # from the first rank's start to the last rank's finish, and a rank that starts late or finishes early idles
        # for the difference (the fill and drain of the pipeline). Barrier latency stays out of the measurement.
        stamps = [torch.zeros(2, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(stamps, torch.tensor([start, done], dtype=torch.float64))
        t0, t1 = min(float(t[0]) for t in stamps), max(float(t[1]) for t in stamps)
        if i:  # the first step also initialises the stages
            times.append(t1 - t0)
            idle.append((WAIT[0] + start - t0 + t1 - done) / times[-1])
            overhead.append((done - start - WAIT[0] - BUSY[0]) / max(n_actions, 1))
    # Per step, the bubble averaged over ranks; then the median over steps, so one late wake-up of this shared
    # host (a few ms, as much as the whole theoretical bubble of the long zero-bubble runs) does not decide a row.
    per_step = torch.tensor(idle, dtype=torch.float64)
    dist.all_reduce(per_step)
    mean_overhead = torch.tensor(statistics.mean(overhead), dtype=torch.float64)
    dist.all_reduce(mean_overhead)
    stats = (statistics.median((per_step / p).tolist()), float(mean_overhead) / p)
    first = next((mod for mod, s in zip(modules, stages) if s.is_first), None)
    label = f"{name} (v = {v})" if vpp else name
    return Row(label, m, statistics.median(times), float(stats[0]), theory, _closed_form(name, p, m, v),
               float(stats[1]) * 1000, first.counter[1] if first else -1)  # fmt: skip


def throughput(steps: int, rounds: int) -> list[float]:
    """Per round: samples/s of a pipelined GPT step on 2 ranks over samples/s of the same step on rank 0 alone.

    Rounds alternate the two measurements seconds apart, so load that drifts on this shared machine hits both.
    """
    from lightning_par.blocks.trunk import find_trunk
    from lightning_par.models import GPT
    from lightning_par.parallel.pipeline.split import split_pipeline

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
    cut = split_pipeline(model, trunk, schedule="1f1b", pp=2, pp_rank=dist.get_rank(), group=world,
                         microbatches=4, device=torch.device("cpu"))  # fmt: skip
    runner = cut.install()
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
    parser.add_argument("--f-ms", type=float, default=100.0, help="F = B = W per microbatch per rank, in ms")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="m in {p, 2p} only, 1 step")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the throughput comparison")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES), help="subset of schedules to run")
    parser.add_argument("--ks", nargs="*", type=int, default=[1, 2, 4, 8], help="microbatches m = k x p, these k")
    parser.add_argument("--skip-throughput", action="store_true", help="only the bubble and in-flight tables")
    parser.add_argument("--skip-bubble", action="store_true", help="only the throughput comparison (p = 2)")
    parser.add_argument("--vpp", nargs="*", type=int, default=[],
                        help="also run the looped interleaved schedules with these stages per rank")  # fmt: skip
    args = parser.parse_args()
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    f = args.f_ms / 1000
    steps = 1 if args.quick else args.steps
    rows = []
    for name in () if args.skip_bubble else args.schedules:
        for k in (1, 2) if args.quick else args.ks:
            m = k * p
            if (name == "dualpipev" and m < 2 * p) or (name == "1f1b" and m < p):
                continue
            rows.append(bubble(name, m, f, steps))
            if SCHEDULES[name].virtual > 1 and SCHEDULES[name].style == "loop":
                rows += [bubble(name, m, f, steps, v) for v in args.vpp]
    if rank == 0 and rows:
        print(f"\n## Bubble, p = {p}, F = B = W = {args.f_ms} ms per microbatch per rank\n")
        print(
            "| schedule | m | step (ms) | bubble measured | theory (table) | closed form | measured / theory "
            "| overhead per action (ms) | peak in flight |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            closed = f"{r.closed:.3f}" if r.closed is not None else "-"
            print(f"| {r.name} | {r.m} | {r.step * 1000:.0f} | {r.idle:.3f} | {r.theory:.3f} | {closed} "
                  f"| {r.idle / r.theory:.3f} | {r.overhead_ms:.2f} | {r.peak} |")  # fmt: skip
    if p == 2 and not args.skip_throughput:
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
