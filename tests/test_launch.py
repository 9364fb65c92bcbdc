"""Launching: Lightning's own process launcher, torchrun across 2 "nodes" on loopback, SLURM's environment, and a
failing rank that must end the whole job with its own error instead of hanging."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import WORKER, capped, kill_session, launcher_keys, run_session, worker_env, write_spec
from parity import rel


def _free_port() -> int:
    # Free now, bound later by the job's rank 0: another process may take it in between, so the tests that use it
    # retry with a new port when the job reports the clash (`_port_clash`).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_clash(logs: list[str]) -> bool:
    return any("address already in use" in log.lower() or "EADDRINUSE" in log for log in logs)


def _spec(tmp: Path, jobs: list[dict]) -> tuple[Path, Path]:
    out, spec = tmp / "out.pt", tmp / "spec.json"
    write_spec(spec, out, jobs)
    return out, spec


def _start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    # A session of its own: what torchrun or Lightning start is killed with it (`_communicate`).
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _communicate(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    try:
        return [p.communicate(timeout=capped(timeout))[0] for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, whatever failed (the test's own timeout included)
            kill_session(p)


@pytest.mark.slow
def test_lightning_starts_the_processes_itself(tmp_path, references):
    # Plain `python script.py` with Trainer(devices=2): Lightning re-runs the script for rank 1.
    out, spec = _spec(tmp_path, [{"model": "gpt", "strategy": "zero2", "devices": 2, "world": 2}])
    proc = run_session([sys.executable, str(WORKER), str(spec)], env=worker_env(), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)[0]
    assert got["layout"]["world_size"] == 2 and got["layout"]["dp_shard"] == 2
    assert rel(got["losses"], references["gpt"]["losses"]) < 1e-5


@pytest.mark.slow
def test_torchrun_two_nodes_with_hybrid_sharding(tmp_path, references):
    """2 nodes x 2 processes over loopback (torchrun --nnodes 2), ZeRO-3 across all 4 ranks and HSDP."""
    jobs = [
        {"model": "gpt", "strategy": "zero3", "num_nodes": 2},
        {"model": "gpt", "strategy": {"zero_stage": 3, "dp_replicate": 2}, "num_nodes": 2},
        {"model": "gpt", "strategy": {"zero_stage": 2, "dp_replicate": 2}, "num_nodes": 2},
        {"model": "gpt_sgd", "strategy": {"zero_stage": 1, "dp_replicate": 2}, "num_nodes": 2},
    ]
    out, spec = _spec(tmp_path, jobs)
    for _attempt in range(3):
        port = _free_port()
        procs = []
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}", str(WORKER),
                   str(spec)]  # fmt: skip
            procs.append(_start(cmd, worker_env(), tmp_path))
        logs = _communicate(procs, timeout=300)
        if not _port_clash(logs):
            break
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = torch.load(out, weights_only=False)
    layouts = [r["layout"] for r in results]
    assert [(lay["num_nodes"], lay["world_size"], lay["dp_replicate"], lay["dp_shard"]) for lay in layouts] == [
        (2, 4, 1, 4), (2, 4, 2, 2), (2, 4, 2, 2), (2, 4, 2, 2),
    ]  # fmt: skip
    for r in results[:3]:
        assert rel(r["losses"], references["gpt"]["losses"]) < 1e-5
        for k, v in references["gpt"]["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=3e-5)
    sgd = results[3]
    assert rel(sgd["losses"], references["gpt_sgd"]["losses"]) < 1e-5
    for k, v in references["gpt_sgd"]["params"].items():
        torch.testing.assert_close(sgd["params"][k], v, rtol=1e-5, atol=1e-7)
    # HSDP: optimizer state is sharded over dp_shard=2 only, so each rank holds half of it (not a quarter).
    optim = [m["optim"] for m in results[1]["mem_all"]]
    psi = results[1]["total_param_bytes"]
    assert optim[0] + optim[1] == 2 * psi and optim[0:2] == optim[2:4]


@pytest.mark.slow
def test_slurm_environment_is_detected(tmp_path, references):
    """What `srun --ntasks-per-node 2` sets up, without srun: Lightning's SLURMEnvironment picks it up."""
    out, spec = _spec(tmp_path, [{"model": "gpt", "strategy": "zero1", "devices": 2, "world": 2}])
    for _attempt in range(3):
        procs = []
        job_id = str(10000 + _free_port() % 1000)  # Lightning derives MASTER_PORT from the job id
        for rank in range(2):
            env = worker_env()  # without any launcher's variables: only SLURM's below place the ranks
            env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                       SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", SLURM_JOB_NAME="lp-test",
                       SLURM_JOB_ID=job_id)  # fmt: skip
            procs.append(_start([sys.executable, str(WORKER), str(spec)], env, tmp_path))
        logs = _communicate(procs, timeout=240)
        if not _port_clash(logs):
            break
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = torch.load(out, weights_only=False)[0]
    assert rel(got["losses"], references["gpt"]["losses"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path, launcher):
    # The collectives' timeout (1 h) is far past the session's (120 s): the job can only end in time by the
    # failure itself reaching every rank, never by a collective timing out.
    job = {"model": "gpt_fail", "strategy": {"zero_stage": 2, "timeout_s": 3600}, "steps": 5}
    if launcher == "lightning":
        job.update(devices=2, world=2)
    out, spec = _spec(tmp_path, [job])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
               str(spec)]  # fmt: skip
    else:
        cmd = [sys.executable, str(WORKER), str(spec)]
    proc = run_session(cmd, env=worker_env(), cwd=tmp_path, timeout=120)  # past it, the test fails (a hang)
    assert proc.returncode != 0
    assert "injected failure in training_step on rank 1" in proc.stdout + proc.stderr
    assert not out.exists()


def test_children_do_not_inherit_what_a_launcher_set(monkeypatch):
    # An in-process Lightning fit leaves these in this process's environment. A child that inherited them hung the
    # demo and sweep tests in CI: Lightning believed it was placed already, started no second rank, and waited.
    placed = {"MASTER_PORT": "29512", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "RANK": "0",
              "TORCHELASTIC_RUN_ID": "x", "SLURM_NTASKS": "2", "PL_GLOBAL_SEED": "3"}  # fmt: skip
    for key, value in placed.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LP_KEEP", "1")
    env = worker_env()
    assert not launcher_keys(env) and "MASTER_PORT" not in env and env["LP_KEEP"] == "1"
    assert env["OMP_NUM_THREADS"] == "1" and env["WANDB_MODE"] == "offline"


_CRASH_ONCE = """
import os, sys
from pathlib import Path
marks = Path(sys.argv[1])
rank = os.environ["RANK"]
seen = len(list(marks.glob(f"attempt_*_{rank}")))  # this rank's earlier attempts
(marks / f"attempt_{seen}_{rank}").touch()
if rank == "1" and seen < int(sys.argv[2]):
    os.abort()  # what glibc's heap check does
if sys.argv[3] == "fail":
    raise SystemExit(3)
"""


@pytest.mark.parametrize(("crashes", "then", "code", "attempts"),
                         [(1, "pass", 0, 2), (2, "pass", -6, 2), (0, "fail", 3, 1)])  # fmt: skip
def test_a_forked_job_runs_again_only_after_a_native_crash(tmp_path, crashes, then, code, attempts):
    # tests/launch.py `_launch` (docs/testing.md, "A native crash in a forked rank"): one SIGABRT is run again with
    # a warning, a second is the result, and an ordinary failure is never run again.
    from launch import run_forked

    script = tmp_path / "crash.py"
    script.write_text(_CRASH_ONCE)
    with pytest.warns(UserWarning, match="crashed") if crashes else contextlib.nullcontext():
        done = run_forked(script, [str(tmp_path), str(crashes), then], 2, cwd=tmp_path, timeout=60)
    assert done.returncode == code, done.stdout
    assert len(list(tmp_path.glob("attempt_*_1"))) == attempts
