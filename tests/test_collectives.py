"""The gloo paths of `lightning_par.parallel.collectives`: ZeRO's reduce-scatter and all-gather made of direct sends
and receives. Checked on 3 ranks (an odd world, a 2-D and a padded-length input) against the sums and gathers written
out by hand from every rank's input (each rank rebuilds all inputs from their seeds): bitwise, since the reduce-scatter
sums in rank order; both with ``async_op`` (the sum happens in ``wait``) and without, in float32 and bfloat16; the
all-gather with and without ``skip_own`` (the own part left as it was). In the same spawn, the all-reduce of logged
values (`all_reduce_logged`): mean, sum and max over the world with one collective each and no barrier, and
nothing sent over a one-rank group (a layout without data parallelism), the value unchanged; and
`apart_from_default`: one new group over every rank for the default group, reused, any other group kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_par.parallel import collectives
from lightning_par.parallel.comm_counter import CommCounter
from lightning_par.strategies._processes import all_reduce_logged
from lightning_par.utils import clean_exit

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

WORLD = 3


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for part in (1, 7, 4099):
            numel = WORLD * part
            inputs = [_input(j, numel, dtype) for j in range(WORLD)]
            # Reduce-scatter: rank r keeps the sum over ranks, in rank order, of every rank's part r.
            expected = inputs[0].view(WORLD, -1)[rank].clone()
            for j in range(1, WORLD):
                expected = expected + inputs[j].view(WORLD, -1)[rank]
            for async_op in (False, True):
                got = torch.full((part,), float("nan"), dtype=dtype)
                work = collectives.reduce_scatter_single(got, inputs[rank].clone(), async_op=async_op)
                if async_op:
                    work.wait()
                if not torch.equal(got, expected):
                    failures.append(f"reduce_scatter {dtype} part={part} async={async_op}")
            # All-gather: rank order; with skip_own the own row keeps what the output held.
            mine = inputs[rank][:part].clone()
            full = torch.stack([inputs[j][:part] for j in range(WORLD)])
            for skip_own in (False, True):
                got = torch.full((WORLD, part), -7.0, dtype=dtype)
                work = collectives.all_gather_single(got.view(-1), mine, async_op=True, skip_own=skip_own)
                work.wait()
                want = full.clone()
                if skip_own:
                    want[rank] = -7.0
                if not torch.equal(got, want):
                    failures.append(f"all_gather {dtype} part={part} skip_own={skip_own}")
    # A 2-D input is read as its flat elements, as torch's reduce_scatter_tensor does.
    x = _input(rank, WORLD * 6, torch.float32).view(WORLD * 2, 3)
    got = torch.empty(6)
    collectives.reduce_scatter_single(got, x)
    ref = x.reshape(-1).clone()
    dist.all_reduce(ref)
    if not torch.allclose(got, ref.view(WORLD, -1)[rank], rtol=1e-6, atol=1e-6):
        failures.append("reduce_scatter 2-D input against all_reduce")
    singles = [dist.new_group([j]) for j in range(WORLD)]  # every rank creates every group, in the same order
    failures += _logged_values(rank, singles[rank])
    # A twin of the default group for collectives left in flight, made once per process; other groups stay.
    twin = collectives.apart_from_default(dist.group.WORLD, None)
    if twin is dist.group.WORLD or dist.get_process_group_ranks(twin) != list(range(WORLD)):
        failures.append("apart_from_default(WORLD) is not a new group over every rank")
    if collectives.apart_from_default(dist.group.WORLD, None) is not twin:
        failures.append("apart_from_default made a second twin")
    if collectives.apart_from_default(singles[rank], None) is not singles[rank]:
        failures.append("apart_from_default replaced a group that is not the default one")
    torch.save(failures, f"{out}.{rank}")
    clean_exit()  # barrier, teardown, os._exit: gloo ranks may abort at interpreter exit (docs/testing.md)


def _logged_values(rank: int, alone_group: dist.ProcessGroup) -> list[str]:
    failures = []
    counter = CommCounter()
    counter.install()
    try:
        for op, want in (("mean", sum(range(1, WORLD + 1)) / WORLD), ("sum", sum(range(1, WORLD + 1))),
                         ("max", WORLD)):  # fmt: skip
            got = all_reduce_logged(torch.tensor(float(rank + 1)), None, op)
            if got.item() != want:
                failures.append(f"all_reduce_logged {op}: {got.item()} != {want}")
        alone = all_reduce_logged(torch.tensor(float(rank + 1)), alone_group, "mean")
        if alone.item() != rank + 1:
            failures.append(f"all_reduce_logged over one rank changed the value to {alone.item()}")
    finally:
        counter.uninstall()
    calls = {kind: n for (_, kind, _), n in counter.calls.items()}
    if calls != {"all_reduce": 3}:
        failures.append(f"all_reduce_logged issued {calls}, expected 3 all-reduces (one per world call, none alone)")
    return failures


def test_gloo_collectives_and_logged_values_on_three_ranks(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result")
    mp.start_processes(_worker, args=(str(tmp_path / "init"), out), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        assert torch.load(f"{out}.{rank}") == [], f"rank {rank}"
