"""The watchdog (`ParallelStrategy(watchdog=...)`, `lightning_par.callbacks.JobWatchdog`): hangs that name their
cause, a lost rank named, a failing rank's error handed to the others.

- Hangs injected into real 2-rank runs with a 3 s limit (tests/_job_callbacks.py, ``Hang``): a rank never issues
  FSDP2's all-gather under ``zero3``; a rank drops a pipeline send under ``pipe``; a rank's data loader blocks
  under ``zero1``. Every rank ends itself with the watchdog's exit status (124: not killed by the launcher, so no
  process is left), within the limit plus 15 s of the run's start-up, and rank 0's summary names the rank that did
  not reach the collective (its group and sequence number) or the pipeline transfer each rank waits on.
- A rank SIGKILLed in the middle of a step under ``cp``, ``moe`` (2 ranks) and ``pipe_tp`` (4 ranks): every other
  rank ends with an error naming the lost rank, within 20 s of the kill (measured: about 6: the 5 s of silence that
  makes a rank lost, plus a beat); the last checkpoint, written the step before, resumes (``cp``).
- A rank whose training step raises: the others' errors name it and its error.
- Without processes: the summary's rule on reports, and a lost rank seen by the thread while this rank is inside a
  step (where NCCL would leave it blocked).

Spawns: seven 2-rank and one 4-rank forked jobs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from forked import launch
from launch import run_jobs, worker_env, write_spec

from lightning_par.guards.watchdog import HUNG_EXIT, LOST_EXIT, Watchdog, summary

LIMIT = 3
HANGS: dict[str, dict[str, Any]] = {
    "zero3_skip_all_gather": {"model": "gpt", "steps": 4, "strategy": {"zero_stage": 3, "watchdog": LIMIT},
                              "hang": {"kind": "skip_all_gather", "rank": 1, "step": 2}},
    "pipe_skip_send": {"model": "gpt", "steps": 4, "dp": 1, "strategy": {"pp": 2, "watchdog": LIMIT},
                       "hang": {"kind": "skip_send", "rank": 0, "step": 2}},
    "zero1_stall_loader": {"model": "gpt", "steps": 4, "strategy": {"zero_stage": 1, "watchdog": LIMIT},
                           "hang": {"kind": "stall_loader", "rank": 1, "step": 2}},
}  # fmt: skip
KILLS: dict[str, tuple[dict[str, Any], int]] = {
    "cp": ({"model": "gpt", "dp": 1, "strategy": {"cp": 2}}, 2),
    "moe": ({"model": "moe_gpt", "strategy": {"ep": 2}}, 2),
    "pipe_tp": ({"model": "gpt", "dp": 1, "strategy": {"pp": 2, "tp": 2}}, 4),
}


def _run(tmp: Path, job: dict[str, Any], nproc: int) -> tuple[dict[int, int], dict[int, str], float]:
    """Launch one job; every rank's exit status and output, and the seconds the launch took."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "job.json"
    write_spec(spec, tmp / "result.pt", [job])
    start = time.monotonic()
    done = launch("_worker:main", [str(spec)], nproc, env=worker_env(), cwd=tmp, timeout=120, grace=60)
    seconds = time.monotonic() - start
    parts = re.split(r"^---- rank (\d+) \(exit (-?\d+)(?:, failed first)?\) ----$", done.stdout, flags=re.M)
    codes = {int(parts[i]): int(parts[i + 1]) for i in range(1, len(parts), 3)}
    outputs = {int(parts[i]): parts[i + 2] for i in range(1, len(parts), 3)}
    return codes, outputs, seconds


@pytest.fixture(scope="module")
def hangs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hangs")
    return {name: _run(tmp / name, job, 2) for name, job in HANGS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HANGS))
def test_a_hang_ends_every_rank_with_a_report(hangs: dict[str, Any], name: str) -> None:
    codes, outputs, seconds = hangs[name]
    assert codes == {0: HUNG_EXIT, 1: HUNG_EXIT}, outputs  # each rank ended itself: none left for the launcher
    assert seconds < LIMIT + 15, seconds
    report = outputs[0]
    assert "lightning_par watchdog, rank 0: the job is stuck" in report, report
    assert "rank 0 prints the summary" in outputs[1], outputs[1]
    if name == "zero3_skip_all_gather":  # rank 1 never issued it: it is one collective behind on dp_shard
        assert re.search(r"Ranks \[1\] did not reach collective #(\d+) on dp_shard \(all_gather\w*\) that ranks "
                         r"\[0\] wait in", report), report  # fmt: skip
        # torch's flight recorder saw rank 0 enqueue the all-gather on dp_shard
        assert re.search(r"rank 0 .*flight recorder\): dp_shard #\d+ gloo:all_gather", report), report
    elif name == "pipe_skip_send":  # stage 1 waits for the activation rank 0 never sent; rank 0 for its gradient
        assert re.search(r"Rank 1 waits on a pipeline transfer: stage 1, forward microbatch \d+.*from rank 0", report)
        assert re.search(r"Rank 0 waits on a pipeline transfer: stage 0.*bwd_recv from rank 1", report), report
    else:
        assert re.search(r"Ranks \[1\] did not reach collective #\d+ on dp_shard .* rank 1: data loader", report), (
            report)  # fmt: skip


@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("kills")
    out = {}
    for name, (job, nproc) in KILLS.items():
        ckpt = tmp / name / "ckpt"
        job = {**job, "steps": 4, "sigkill_at_step": {"step": 2, "rank": 1}, "ckpt_dir": str(ckpt),
               "ckpt_every_n_steps": 1}  # fmt: skip
        out[name] = (*_run(tmp / name, job, nproc), ckpt, job)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KILLS))
def test_a_killed_rank_ends_the_others_naming_it(kills: dict[str, Any], name: str) -> None:
    codes, outputs, seconds, _, _ = kills[name]
    assert codes[1] == -9
    others = [r for r in codes if r != 1]
    assert all(codes[r] == 1 for r in others), (codes, outputs)  # their own error, not the launcher's kill
    for r in others:
        assert "lightning_par: rank(s) [1] stopped without an error of their own" in outputs[r], outputs[r]
    assert seconds < 20 + 10, seconds  # the kill comes a few seconds into the run


@pytest.mark.slow
def test_the_last_checkpoint_before_the_kill_resumes(kills: dict[str, Any], tmp_path: Path) -> None:
    job = kills["cp"][4]
    job = {k: v for k, v in job.items() if k != "sigkill_at_step"}
    got = run_jobs(tmp_path, [{**job, "resume": "latest"}], nproc=2)[0]
    assert got["latest_before"] == "step=2.ckpt" or got["latest_before"].startswith("epoch=0-step=2"), got
    assert got["start_step"] == 2 and len(got["losses"]) == 2


@pytest.mark.slow
def test_a_failing_rank_is_named_in_the_others_errors(tmp_path: Path) -> None:
    job = {"model": "gpt", "steps": 4, "strategy": {"zero_stage": 3}, "fail_at_step": 2}
    codes, outputs, _ = _run(tmp_path, job, 2)
    assert codes == {0: 1, 1: 1}, outputs
    assert "injected failure on rank 1" in outputs[1]
    assert "lightning_par: rank 1 failed before this one (RuntimeError: injected failure on rank 1" in outputs[0], (
        outputs[0])  # fmt: skip


# ---- without processes ------------------------------------------------------------------------------------------
def _report(rank: int, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "step": 5, "seconds": 12.0, "limit": 10.0, "over": True, "where": "f.py:1 g", **fields}


def test_the_summary_names_the_ranks_behind_on_a_group() -> None:
    reports = {
        0: _report(0, op="all_gather_into_tensor", group="dp_shard", ranks=[0, 1, 2, 3], seq=40),
        1: _report(1, op="all_gather_into_tensor", group="dp_shard", ranks=[0, 1, 2, 3], seq=40),
        2: _report(2, op="data loader (fetching the next batch)", over=False, step=None, seconds=0.0),
        3: _report(3, op="all_reduce", group="dp_shard", ranks=[0, 1, 2, 3], seq=39),
    }
    text = summary(reports, 4, lost=[])
    assert "Ranks [2, 3] did not reach collective #40 on dp_shard (all_gather_into_tensor) that ranks [0, 1]" in text
    assert "rank 2: data loader" in text and "rank 3: all_reduce" in text
    assert f"exit status {HUNG_EXIT}" in text


def test_a_lost_rank_ends_a_rank_blocked_in_a_step() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    exits: list[int] = []
    dog = Watchdog(store, 0, 2, {}, lost_after_s=1.0, beat_s=0.1, exit=exits.append)
    dog._set("beat/1", "7")  # rank 1 beat once, then went silent (no end mark)
    dog.step_started(3)
    dog.start()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.1)
    dog.stop()
    assert exits[:1] == [LOST_EXIT]
    # A rank that left with its end mark is not lost.
    exits.clear()
    dog = Watchdog(store, 0, 2, {}, lost_after_s=1.0, beat_s=0.1, exit=exits.append)
    dog._set("beat/1", "7")
    dog._set("end/1", "done")
    dog.step_started(3)
    dog.start()
    time.sleep(2.0)
    dog.stop()
    assert exits == []
