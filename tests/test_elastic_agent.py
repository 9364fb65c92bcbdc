"""torchrun's elastic agents losing and regaining a node: 4 ranks -> 2 -> 4 on the uninterrupted loss curve.

Two agents on loopback (``--nnodes 1:2 --nproc-per-node 2``, c10d rendezvous) run `tests/_elastic_train.py`
(ZeRO-2, ``global_batch=8``, a checkpoint after every step, ``ckpt_path="last"``). After step 2 the second agent
is killed with SIGKILL (a node lost): the first agent's workers fail, it restarts them at world size 2 (accumulation
2), and they resume from the last complete checkpoint. Once a step has run on 2 ranks the second agent is started
again: the first agent sees it waiting, restarts its workers, and both continue on 4 ranks to step 8.

Checked against the same script run uninterrupted on 4 ranks: every step is logged, world sizes 4, 2 and 4 were
seen, and every step run on 4 ranks after the node came back has the uninterrupted run's loss (1e-5 relative, fp32;
a 2-rank step logs its last micro-batch's loss, not comparable). ~2 minutes here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launch import capped, run_session, worker_env
from parity import rel

pytestmark = pytest.mark.slow  # multi-process, ~1-2 minutes: the slow tier (README)

SCRIPT = Path(__file__).with_name("_elastic_train.py")
STEPS = 8


def _free_port() -> int:
    # Free now, bound later by the first agent: `_first_agent` retries with another port if it was taken meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _first_agent(out: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """The agent that hosts the rendezvous store, started and listening (the one killed later must not host it)."""
    for _attempt in range(3):
        port = _free_port()
        agent = _agent(out, port, log)
        _wait(lambda p=port, a=agent: _listening(p) or a.poll() is not None, 120, "the first agent's store", [log])
        if agent.poll() is None:
            return agent, port
        if "address already in use" not in log.read_text().lower():
            raise AssertionError(f"the first agent ended before its store listened:\n{log.read_text()[-3000:]}")
    raise AssertionError("three ports taken between picking and binding them")


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _agent(out: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", "5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--rdzv-conf", "join_timeout=120,last_call_timeout=3",
           "--monitor-interval", "1", str(SCRIPT), str(out), str(STEPS), "1.5"]  # fmt: skip
    env = {**worker_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill_node(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(pred: Any, timeout: float, what: str, logs: list[Path]) -> None:
    end = time.monotonic() + capped(timeout)  # never past the test's own limit (tests/launch.py)
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("elastic_agent")
    ref = tmp / "ref"
    ref.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT),
           str(ref), str(STEPS), "0"]  # fmt: skip
    done = run_session(cmd, env=worker_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = tmp / "elastic"
    out.mkdir()
    logs = [tmp / "agent_a.log", tmp / "agent_b.log", tmp / "agent_b2.log"]
    first, port = _first_agent(out, logs[0])
    agents = [first]
    try:
        agents.append(_agent(out, port, logs[1]))
        _wait(lambda: any(r["step"] >= 2 and r["world"] == 4 for r in _steps(out)), 240, "step 2 on 4 ranks", logs)
        _kill_node(agents[1].pid)  # a node is lost: its agent and its workers
        agents[1].wait(timeout=30)
        _wait(lambda: any(r["world"] == 2 for r in _steps(out)), 240, "a step on 2 ranks", logs)
        agents.append(_agent(out, port, logs[2]))  # the node is back
        _wait(lambda: agents[0].poll() is not None and agents[2].poll() is not None, 300, "the end", logs)
        assert agents[0].returncode == 0 and agents[2].returncode == 0, "\n".join(p.read_text()[-3000:] for p in logs)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent.pid)
    return {"ref": _steps(ref), "elastic": _steps(out)}


def test_the_job_shrinks_and_grows_and_finishes(runs):
    rows = runs["elastic"]
    worlds = [r["world"] for r in rows]
    first_two = worlds.index(2)
    assert 4 in worlds[:first_two] and 4 in worlds[first_two:]  # 4 -> 2 -> 4
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))  # every step ran (some twice: restarts)


def test_steps_on_four_ranks_after_the_node_came_back_follow_the_uninterrupted_curve(runs):
    ref = {r["step"]: r["loss"] for r in runs["ref"]}
    rows = runs["elastic"]
    back = [r for i, r in enumerate(rows) if r["world"] == 4 and any(q["world"] == 2 for q in rows[:i])]
    assert back and back[-1]["step"] == STEPS
    assert rel([r["loss"] for r in back], [ref[r["step"]] for r in back]) < 1e-5
