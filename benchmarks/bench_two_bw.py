"""PipeDream-2BW against 1F1B on the same stages: the bubble per step, measured and replayed, and the step time.

Launch with p ranks (2 or 4), one thread each:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_two_bw.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_two_bw.py

The model is p blocks whose forward sleeps F = ``--f-ms`` and whose backward sleeps 2F (a full backward: input and
weight gradients), so the stages measure the schedule, not this 2-core machine's contention (as
`bench_pipeline_bubble.py` does). Each schedule drives its own copy through `PipelineRunner.train_step`, the code a
fit runs (`pp_schedule="1f1b"`: torch's `Schedule1F1B`; ``"2bw"``: `lightning_par.parallel.pipeline.two_bw`), one
barrier between steps (a fit's loss broadcast from the last stage). Rounds alternate the two schedules; per round
and schedule the median over its steps of:

- the measured bubble: per rank, 1 - (its actions' time, from the runner's own trace) / the step's time (the
  slowest rank's), averaged over ranks: the replay's definition, fill and drain included (`ParallelismMonitor`'s
  ``pipe/bubble`` counts a rank's waits inside the schedule only);
- the step time: the slowest rank's.

Theory: each schedule's table replayed with F = 1, B = 2 and free communication
(`lightning_par.analysis.pipeline_timeline`): (p-1)/(m+p-1) for 1F1B; for 2BW's steady-state step (the forwards of
this step beside the backwards of the microbatches the previous one left in flight) (p-1)/(3m+p-1) for p <= 4.
Reported: measured / theory per schedule, and the step-time ratio 2BW / 1F1B with its replayed value
(3m + p - 1) / (3 (m + p - 1)). The first step of each run (2BW's warm-up: forwards only) is not timed.
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

from lightning_par.analysis.pipeline_timeline import one_f_one_b_order, replay, two_bw_order  # noqa: E402
from lightning_par.blocks.trunk import find_trunk  # noqa: E402
from lightning_par.parallel.pipeline.split import split_pipeline  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class _Sleep(torch.autograd.Function):
    """Forward sleeps ``f`` seconds, backward ``2 f``: a stage's compute without using a core."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, f: float) -> Tensor:
        ctx.f = f
        time.sleep(f)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        time.sleep(2 * ctx.f)
        return grad, grad.sum().reshape(1), None


class _Block(nn.Module):
    def __init__(self, f: float) -> None:
        super().__init__()
        self.w, self.f = nn.Parameter(torch.ones(1)), f

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x, self.w, self.f)


class _Model(nn.Module):
    def __init__(self, p: int, f: float) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 8), nn.ModuleList(_Block(f) for _ in range(p)), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).mean()


def _run(schedule: str, p: int, m: int, f: float, steps: int) -> tuple[float, float]:
    """(median bubble averaged over ranks, median slowest-rank step seconds) of ``steps`` timed steps."""
    model = _Model(p, f)
    trunk = find_trunk(model)
    assert trunk is not None
    world = dist.group.WORLD
    assert world is not None
    cut = split_pipeline(model, trunk, schedule=schedule, pp=p, pp_rank=dist.get_rank(), group=world,
                         microbatches=m, device=torch.device("cpu"))  # fmt: skip
    runner = cut.install()
    batch = torch.randn(2 * m, 8)
    bubbles, times = [], []
    for i in range(steps + 1):
        dist.barrier()
        runner.train_step(batch, lambda mb, _spec: model(mb), lambda loss: loss / m)
        record = runner.trace.last
        assert record is not None
        busy = sum(s.end - s.start for s in record.spans if s.kind in "FBIW")
        got = torch.tensor([busy, record.duration])
        every = [torch.zeros(2) for _ in range(p)]
        dist.all_gather(every, got)
        if i:  # the first step: 2BW's warm-up (forwards only), and set-up for both
            step = max(float(t[1]) for t in every)
            bubbles.append(statistics.mean(1 - float(t[0]) / step for t in every))
            times.append(step)
    return statistics.median(bubbles), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--f-ms", type=float, default=40.0, help="forward sleep per microbatch per stage, in ms")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ks", nargs="*", type=int, default=[1, 2, 4], help="microbatches m = k x p, these k")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    p, f = dist.get_world_size(), args.f_ms / 1000
    rows = []
    for k in args.ks:
        m = k * p
        theory = {"1f1b": replay(one_f_one_b_order(p, m), 1.0, 1.0, 1.0).bubble,
                  "2bw": replay(*two_bw_order(p, m)[:1], 1.0, 1.0, 1.0, given=two_bw_order(p, m)[1]).bubble}
        measured: dict[str, list[tuple[float, float]]] = {"1f1b": [], "2bw": []}
        for r in range(args.rounds):
            order = ("1f1b", "2bw") if r % 2 == 0 else ("2bw", "1f1b")
            for schedule in order:
                measured[schedule].append(_run(schedule, p, m, f, args.steps))
        med = {s: (statistics.median(b for b, _ in v), statistics.median(t for _, t in v)) for s, v in measured.items()}
        ratio = med["2bw"][1] / med["1f1b"][1]
        rows.append((m, med, theory, ratio, (3 * m + p - 1) / (3 * (m + p - 1))))
    if dist.get_rank() == 0:
        print(f"p = {p}, F = {args.f_ms:.0f} ms, B = {2 * args.f_ms:.0f} ms, {args.rounds} rounds x {args.steps} steps")
        print("| m | 1F1B bubble (theory) | 2BW bubble (theory) | measured / theory 1F1B, 2BW | step 2BW / 1F1B "
              "(replayed) |")
        print("|---|---|---|---|---|")
        for m, med, theory, ratio, ideal in rows:
            print(f"| {m} | {med['1f1b'][0]:.3f} ({theory['1f1b']:.3f}) | {med['2bw'][0]:.3f} ({theory['2bw']:.3f}) | "
                  f"{med['1f1b'][0] / theory['1f1b']:.3f}, {med['2bw'][0] / theory['2bw']:.3f} | {ratio:.3f} "
                  f"({ideal:.3f}) |")
    clean_exit()


if __name__ == "__main__":
    main()
