"""Test ranks forked from one process that imported torch, Lightning and the test worker once.

A rank started by ``python -m torch.distributed.run`` pays 4-5 CPU-s importing torch and Lightning before it trains,
and a tiny fit costs 0.2-0.4 CPU-s (docs/testing.md, "What a spawn costs"), so start-up was most of the suite. Here
multiprocessing's *forkserver* imports the heavy modules once per pytest session (`_preload`) and every rank is a
fork of it. Each rank gets what torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` / ``MASTER_PORT``, ``TORCHELASTIC_*``), so the code under test sees a torchrun job; the rendezvous
store is held by the launching process, as torchrun's agent holds it (``TORCHELASTIC_USE_AGENT_STORE``), on a port
the OS gave it when it bound: no port is picked, released and reused.

Tests of launching itself (torchrun, Lightning's launcher, SLURM, the elastic agent, restarts after a crash, the CLI)
keep real process launches (`launch.run_session`).

No rank outlives its test: each rank leads a process group of its own (with whatever it starts), and the launcher
kills every group when the job ends for any reason, a failure, its timeout or pytest-timeout's exception included; a
rank whose test process died kills its own group (it polls the test process every second).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

# Imported by the forkserver once per session, before any rank is forked (what every rank would import anyway).
_PRELOAD = ["_forked_preload"]
_CONTEXT: Optional[Any] = None


def start(env: dict[str, str]) -> Any:
    """Start the session's forkserver (once) with environment ``env``, what its imports may read (OpenMP reads
    ``OMP_NUM_THREADS`` when torch loads it); return the multiprocessing context that forks from it."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD)
        # The server imports its preload before it applies this process's sys.path (Python 3.11's
        # forkserver.main), and an ImportError there is silent: it finds the tests folder through PYTHONPATH.
        here = Path(__file__).resolve().parent
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _CONTEXT


class Launched:
    """What a forked job left: its return code (the first failing rank's, else 0) and every rank's output.

    Args:
        returncode: 0 when every rank exited 0; else the first failing rank's code (negative: killed by a signal).
        stdout: every rank's output (stdout and stderr together), rank by rank, the ranks that failed last, the one
            that failed first at the end.
        timed_out: the job ran past its timeout and was killed.
    """

    def __init__(self, returncode: int, stdout: str, timed_out: bool) -> None:
        self.returncode, self.stdout, self.timed_out = returncode, stdout, timed_out
        self.stderr = ""


def _watch(test_pid: int) -> None:
    """Kill this rank's process group when the test process is gone (pytest killed from outside)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(test_pid, 0)
            except ProcessLookupError:
                os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="test-process-watch").start()


def _rank_main(target: str, argv: Sequence[str], env: dict[str, str], cwd: str, log: str, test_pid: int) -> None:
    """Runs in the forked rank: its own process group, its output to ``log``, the job's environment, then the
    target (``module:function`` or the path of a script run as ``__main__``); never returns."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a rank that ran past its timeout shows its stacks
    faulthandler.enable(all_threads=True)  # a rank killed by SIGABRT / SIGSEGV (a C++ abort) shows where it was
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the server's choice is cached: follow this job's TMPDIR
    # A rank started by forkserver inherits that start method; a rank torchrun starts has Linux's default, which
    # data-loader workers rely on (their arguments need not pickle).
    multiprocessing.set_start_method("fork", force=True)
    os.chdir(cwd)
    _watch(test_pid)
    code = 0
    try:
        if target.endswith(".py"):
            sys.argv = [target, *argv]
            runpy.run_path(target, run_name="__main__")
        else:
            module, _, function = target.partition(":")
            imported = importlib.import_module(module)
            sys.argv = [str(getattr(imported, "__file__", module)), *argv]  # as `python that_file.py ...`
            getattr(imported, function)()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _torchrun_env(env: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    # What torch.distributed.run sets for each worker of a one-node job (torch/distributed/elastic/agent/server/
    # local_elastic_agent.py, `_start_workers`).
    return {
        **env,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip


def launch(
    target: str,
    argv: Sequence[str],
    nproc: int,
    *,
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    grace: float = 20.0,
) -> Launched:
    """Run ``target`` as ``nproc`` forked ranks of one torchrun-style job (one plain process when ``nproc == 1``).

    Args:
        target: ``"module:function"`` (a module the forkserver can import, e.g. ``"_worker:main"``) or the path of a
            script run as ``__main__``.
        argv: the ranks' ``sys.argv[1:]``.
        nproc: ranks.
        env: the ranks' whole environment (the rank variables are added).
        cwd: the ranks' working directory; their output goes to ``rank_<i>_<id>.log`` there until the job ends.
        timeout: seconds before every rank is killed.
        grace: seconds the other ranks get to end on their own after one failed, before they are killed.
    """
    from torch.distributed import TCPStore

    ctx = start(env)
    cwd.mkdir(parents=True, exist_ok=True)
    store = TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False) if nproc > 1 else None
    run_id = uuid.uuid4().hex[:8]
    logs = [cwd / f"rank_{rank}_{run_id}.log" for rank in range(nproc)]
    procs = []
    for rank in range(nproc):
        rank_env = _torchrun_env(env, rank, nproc, store.port, run_id) if store is not None else dict(env)
        procs.append(ctx.Process(target=_rank_main, args=(target, list(argv), rank_env, str(cwd), str(logs[rank]),
                                                          os.getpid()), daemon=False))  # fmt: skip
    deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
    failed: list[int] = []  # ranks in the order their failure was seen: the first is usually the cause
    try:
        with _without_main():
            for p in procs:
                p.start()
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            failed += [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in failed]
            if failed_at is None and failed:
                failed_at = now  # torchrun's rule: one rank failed, the job ends
            if failed_at is not None and now > failed_at + grace:
                break
            live = [p.sentinel for p in procs if p.exitcode is None]
            multiprocessing.connection.wait(live, timeout=0.5)
    finally:
        if timed_out:
            _dump_stacks(procs)
        _kill(procs)
        if store is not None:
            del store
    codes = [p.exitcode if p.exitcode is not None else -signal.SIGKILL for p in procs]
    failed += [r for r, c in enumerate(codes) if c != 0 and r not in failed]
    returncode = codes[failed[0]] if failed else 0
    if timed_out:
        returncode = returncode or -signal.SIGKILL
    texts = []
    for log in logs:
        texts.append(log.read_text(errors="replace") if log.exists() else "")
        log.unlink(missing_ok=True)  # its text is in the result: a folder the ranks ran in (the checkout) stays clean
    # The rank that failed first goes last: a report that shows the output's tail shows the cause, not the other
    # ranks' "connection closed by peer".
    order = [r for r in range(nproc) if r not in failed] + failed[::-1]
    out = [f"---- rank {r} (exit {codes[r]}{', failed first' if failed and r == failed[0] else ''}) ----\n{texts[r]}"
           for r in order]  # fmt: skip
    return Launched(returncode, "\n".join(out), timed_out)


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start processes without re-importing this process's ``__main__`` in them (multiprocessing's default: a
    script that launches at import would launch again in every rank); the ranks' targets import what they need."""
    get = multiprocessing.spawn.get_preparation_data

    def prepared(name: str) -> dict[str, Any]:
        data = get(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = prepared  # type: ignore[assignment]
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = get  # type: ignore[assignment]


def _dump_stacks(procs: list[Any]) -> None:
    """Ask every live rank for its threads' stacks (into its log) before it is killed: where a hang waits."""
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)


def _kill(procs: list[Any]) -> None:
    """SIGKILL every rank's process group that is still there (what the rank started goes with it)."""
    for p in procs:
        if p.pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, signal.SIGKILL)  # killed before it led its own group
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
