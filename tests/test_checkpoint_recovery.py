"""Asynchronous save, keeping the last K checkpoints, and recovery from a killed rank under torchrun --max-restarts.

Design: as in test_checkpoint.py, one step per epoch over a fixed set of samples (the whole set is one global
batch), so every step sees the same samples whatever the sampler's epoch seed, and a run resumed from any step
must continue the uninterrupted run's loss curve. Checkpoints are written by ModelCheckpoint after every step
(``every_n_train_steps=1``, ``save_top_k=2`` by ``step``, ``save_last=True``), validation off. Tolerances as in
test_zero.py (losses 1e-5 relative; AdamW parameters 1e-5 relative + 1% of the learning rate absolute); measured:
bit-identical.

Spawns: one 2-rank torchrun for the keep-K and async jobs (~10 s), and three 2-rank torchrun jobs with
``--max-restarts 1`` in which rank 1 SIGKILLs itself on the first attempt, between steps or inside a save (~10 s
each). Each has a hard timeout, and its process group is killed in ``finally``. torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store shared between attempts, gloo sometimes reads the
previous attempt's addresses on restart and fails to connect (pytorch/pytorch#135712; 1 in 2 restarts here).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import WORKER, capped, run_jobs, worker_env, write_spec
from parity import rel

LR = 3e-3
STEPS = 6
KEEP = 2
BASE: dict[str, Any] = {
    "model": "gpt",
    "epoch_steps": 1,
    "max_steps": STEPS,
    "limit_val_batches": 0,
    "ckpt_every_n_steps": 1,
    "save_top_k": KEEP,
    "save_last": True,
}
ASYNC3 = {"zero_stage": 3, "async_save": True, "timeout_s": 60}


def _params_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=0.01 * LR, msg=lambda m, k=k: f"{k}: {m}")


def _full_state(path: Path) -> dict[str, Any]:
    from lightning_par.checkpoint import load_full_state

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load in a single process")
        return load_full_state(path)


# ---- keep the last K, sync and async; async writes the state at the save call -----------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("keep")
    jobs = {
        "sync": {**BASE, "strategy": "zero3"},
        "async": {**BASE, "strategy": ASYNC3, "write_after_next_step": True},
        # top-k alone (no last.ckpt), K=3, ZeRO-1 (plain replicated parameters, optimizer state as DTensor shards)
        "async_top3": {**BASE, "strategy": {"zero_stage": 1, "async_save": True}, "save_top_k": 3, "save_last": False},
        # Every write starts only after the next step ended: training runs on while a checkpoint is written, and
        # must not change what is written; the background copy of parameters and optimizer state sleeps 0.2 s
        # first, so the next optimizer step must wait for it. Every 2nd step, all kept.
        "async_slow": {**BASE, "strategy": {"zero_stage": 2, "async_save": True}, "ckpt_every_n_steps": 2,
                       "save_top_k": -1, "save_last": False, "write_after_next_step": True, "slow_staging_s": 0.2,
                       "record_step_params": True},
    }  # fmt: skip
    for name, job in jobs.items():
        job["ckpt_dir"] = str(tmp / name)
    results = run_jobs(tmp, list(jobs.values()), nproc=2, timeout=240)
    return {"dir": tmp, **dict(zip(jobs, results, strict=True))}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sync", ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]),
        ("async", ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]),
        ("async_top3", ["step=4.ckpt", "step=5.ckpt", "step=6.ckpt"]),
        ("async_slow", ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]),
    ],
)
@pytest.mark.slow
def test_exactly_the_last_k_checkpoints_remain_and_no_partial_folders(runs, name, expected):
    from lightning_par.checkpoint import latest

    folder = runs["dir"] / name
    assert sorted(os.listdir(folder)) == expected  # no .tmp or .old left behind
    assert runs[name]["ckpt_listing_after"] == expected  # already so when fit returned: it waited for the last save
    for ckpt in expected:
        step = STEPS if ckpt == "last.ckpt" else int(ckpt.removeprefix("step=").removesuffix(".ckpt"))
        assert _full_state(folder / ckpt)["global_step"] == step
    assert latest(folder) == folder / ("last.ckpt" if "last.ckpt" in expected else "step=6.ckpt")


@pytest.mark.slow
def test_async_save_trains_and_writes_exactly_as_sync(runs):
    sync, asyn = runs["sync"], runs["async"]
    assert asyn["losses"] == sync["losses"] and len(sync["losses"]) == STEPS
    for key in ("last.ckpt", "step=5.ckpt"):
        a, s = _full_state(runs["dir"] / "async" / key), _full_state(runs["dir"] / "sync" / key)
        assert a["global_step"] == s["global_step"]
        for group in ("state_dict", "optimizer_0"):
            flat_a, flat_s = _tensors(a[group]), _tensors(s[group])
            assert flat_a.keys() == flat_s.keys() and flat_a
            assert all(torch.equal(flat_a[k], flat_s[k]) for k in flat_s), group
    # Training went on while checkpoints were being written (counted at step ends; at most one save in flight; each
    # write waits for the next step's end, so this holds on any machine).
    assert asyn["steps_while_writing"] > 0 and sync["steps_while_writing"] == 0


@pytest.mark.slow
def test_async_checkpoint_holds_the_state_at_the_save_call(runs):
    slow = runs["async_slow"]
    # Steps 3 and 5 ended while the saves of steps 2 and 4 were still writing (each write waits for the next step).
    assert slow["steps_while_writing"] >= 2
    for step in (2, 4, 6):
        saved = _full_state(runs["dir"] / "async_slow" / f"step={step}.ckpt")
        assert saved["global_step"] == step
        at_save = slow["step_params"][step]
        assert saved["state_dict"].keys() == at_save.keys()
        for name, value in at_save.items():
            assert torch.equal(saved["state_dict"][name].float(), value), (step, name)
        if step < STEPS:  # and not the state of the step after it, which training wrote meanwhile
            after = slow["step_params"][step + 1]
            assert not all(torch.equal(saved["state_dict"][n].float(), after[n]) for n in after)


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}.{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}.{i}"))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree
    return out


# ---- crash recovery: a rank SIGKILLed, torchrun restarts the job, which resumes by itself -------------------------
def _torchrun_with_restart(tmp: Path, job: dict[str, Any], timeout: float = 150) -> tuple[dict[str, Any], str]:
    """The job under torchrun with one restart allowed. Once more from scratch, with a warning, when a store could
    not bind its port: torchrun's agent picks a free one, and between that and the restarted workers' bind another
    test's process can take it (EADDRINUSE, seen once in CI on 2026-12-06): the machine's race, not the code's."""
    try:
        return _torchrun_once(tmp, job, timeout)
    except AssertionError as err:
        if "EADDRINUSE" not in str(err):
            raise
        warnings.warn(f"torchrun's port was taken between its pick and its bind; running again:\n{str(err)[-2000:]}",
                      stacklevel=2)  # fmt: skip
        for left in (tmp / "out.pt", tmp / "spec.json"):
            left.unlink(missing_ok=True)
        shutil.rmtree(job["ckpt_dir"], ignore_errors=True)
        return _torchrun_once(tmp, job, timeout)


def _torchrun_once(tmp: Path, job: dict[str, Any], timeout: float) -> tuple[dict[str, Any], str]:
    tmp.mkdir(parents=True, exist_ok=True)
    out, spec = tmp / "out.pt", tmp / "spec.json"
    write_spec(spec, out, [job])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(WORKER), str(spec)]  # fmt: skip
    env = {**worker_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # Own session: the agent and both ranks form one process group, killed whatever happens.
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        log = proc.communicate(timeout=capped(timeout))[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0 and out.exists(), f"torchrun failed ({proc.returncode}):\n{log[-8000:]}"
    return torch.load(out, weights_only=False)[0], log


def _check_resumed_run(got: dict[str, Any], full: dict[str, Any], resumed_from_step: int) -> None:
    assert got["restart_count"] == 1  # this is the second attempt, which ran to the end
    assert got["start_step"] == resumed_from_step
    assert len(got["losses"]) == STEPS - resumed_from_step  # exactly the steps after the checkpoint, once each
    assert rel(got["losses"], full["losses"][resumed_from_step:]) < 1e-5
    _params_close(got["params"], full["params"])
    assert not any(name.endswith((".tmp", ".old")) for name in got["ckpt_listing_after"])


@pytest.mark.slow
def test_rank_killed_between_steps_resumes_from_the_last_checkpoint(runs, tmp_path):
    # Rank 1 dies as step 4 starts (global_step 3). Saves are async: the save of step 3's last.ckpt may still be in
    # flight, so the last complete last.ckpt is that of step 3 or step 2 (never older: one save in flight at most).
    job = {**BASE, "strategy": ASYNC3, "ckpt_dir": str(tmp_path / "ckpts"), "resume": "last",
           "sigkill_at_step": {"step": 3, "rank": 1}}  # fmt: skip
    got, log = _torchrun_with_restart(tmp_path, job)
    # Lightning's ckpt_path="last" resolves our folders. (Once, under load, the restart resumed from nothing; the
    # message shows what the restart found and why the first attempt ended.)
    why = f"found {got['ckpt_listing_before']}; torchrun's output:\n{log[-6000:]}"
    assert got["resumed_from"] == "last.ckpt", why
    assert got["start_step"] in (2, 3), why
    _check_resumed_run(got, runs["async"], got["start_step"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rank_killed_inside_a_save_leaves_the_previous_checkpoint_to_resume_from(runs, tmp_path, mode):
    # Saves 1-4 are step 1's and step 2's (step=N.ckpt, then last.ckpt); rank 1 dies in the 5th, step=3.ckpt, after
    # writing its data file and before DCP's index: a partial folder, which must never be taken for a checkpoint.
    strategy = ASYNC3 if mode == "async" else {"zero_stage": 3, "timeout_s": 60}
    job = {**BASE, "strategy": strategy, "ckpt_dir": str(tmp_path / "ckpts"), "resume": "latest",
           "sigkill_in_save": {"nth": 5, "rank": 1}}  # fmt: skip
    got, _ = _torchrun_with_restart(tmp_path, job)
    before = got["ckpt_listing_before"]  # what the restarted job found
    assert "step=3.ckpt.tmp" in before and "step=3.ckpt" not in before
    assert {"last.ckpt", "step=2.ckpt"} <= set(before)
    # lightning_par.checkpoint.latest skips the newer partial folder; the previous checkpoint loads and resumes.
    assert got["latest_before"] in ("last.ckpt", "step=2.ckpt") and got["resumed_from"] == got["latest_before"]
    _check_resumed_run(got, runs[mode], resumed_from_step=2)
    assert got["ckpt_listing_after"] == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]


# ---- units: no process group ----------------------------------------------------------------------------------
def _write(folder: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {"w": torch.full((4,), float(step))}}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": step}, folder / "meta.pt")
    time.sleep(0.01)  # distinct modification times
    return folder


def test_latest_returns_the_newest_complete_folder(tmp_path):
    from lightning_par.checkpoint import latest

    assert latest(tmp_path / "missing") is None and latest(tmp_path) is None
    _write(tmp_path / "step=1.ckpt", 1)
    good = _write(tmp_path / "step=2.ckpt", 2)
    _write(tmp_path / "step=3.ckpt.tmp", 3)  # complete but never committed: not a checkpoint
    _write(tmp_path / "last.ckpt.old", 3)
    (_write(tmp_path / "step=4.ckpt", 4) / "meta.pt").unlink()  # index but no meta.pt
    broken = _write(tmp_path / "step=5.ckpt", 5) / "__0_0.distcp"
    broken.write_bytes(broken.read_bytes()[:10])  # truncated data file
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        assert latest(tmp_path) == good


@pytest.mark.parametrize("exchange", [True, False])
def test_commit_replaces_an_existing_checkpoint(tmp_path, monkeypatch, exchange):
    from lightning_par.checkpoint import dcp

    real, used = dcp._exchange, []
    # Without renameat2(RENAME_EXCHANGE) (other OS or filesystem): two renames through <path>.old.
    monkeypatch.setattr(dcp, "_exchange", lambda a, b: used.append(exchange and real(a, b)) or used[-1])
    path = _write(tmp_path / "last.ckpt", 1)
    _write(dcp.tmp_path(path), 2)
    dcp.commit(dcp.tmp_path(path), path)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert torch.load(path / "meta.pt")["global_step"] == 2
    assert used == [exchange and sys.platform == "linux"]  # the atomic exchange where the OS has it


def test_async_saver_copies_the_state_before_returning_and_commits_on_wait(tmp_path):
    from datetime import timedelta

    from lightning_par.checkpoint.async_save import AsyncSaver

    saver = AsyncSaver(timedelta(seconds=30))
    weight = torch.arange(6.0)
    view = weight[2:5]  # a view of a larger storage, as ZeRO-1/2 shards are
    path = tmp_path / "step=1.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        saver.save(path, {"state_dict": {"w": weight, "v": view}}, {"global_step": 1}, rank=0)
        weight.add_(100.0)  # training goes on at once
        assert saver.wait() == path
    assert saver.in_flight is None and sorted(os.listdir(tmp_path)) == ["step=1.ckpt"]
    state = _full_state(path)
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0))
    assert torch.equal(state["state_dict"]["v"], torch.arange(2.0, 5.0))


def test_failed_async_save_is_reported_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    from datetime import timedelta

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    from lightning_par.checkpoint import CheckpointError
    from lightning_par.checkpoint.async_save import AsyncSaver

    def no_space(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_FileSystemWriter, "write_data", no_space)
    saver, path = AsyncSaver(timedelta(seconds=30)), tmp_path / "step=1.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(path, {"state_dict": {"w": torch.ones(2)}}, {"global_step": 1}, rank=0)
        with pytest.raises(CheckpointError, match=r"asynchronous save of checkpoint .*step=1.ckpt failed .*No space"):
            saver.wait()
    assert not path.exists() and saver.wait() is None


def test_stager_refills_its_buffers_also_for_ordered_dicts():
    from collections import OrderedDict

    from lightning_par.checkpoint.async_save import _BufferStager

    # Module.state_dict() is an OrderedDict: its tensors must be copied into reused buffers, not deep-copied anew.
    weights = OrderedDict(w=torch.ones(4))
    state = {"state_dict": weights, "optimizer_0": {"state": {"w": {"exp_avg": torch.zeros(4)}}, "param_groups": []}}
    stager = _BufferStager()
    first = stager.capture(state)[0]["state_dict"]["w"]
    weights["w"].add_(1)
    second = stager.capture(state)[0]["state_dict"]["w"]
    assert second.data_ptr() == first.data_ptr() != weights["w"].data_ptr()
    assert torch.equal(second, torch.full((4,), 2.0))


def _gated_staging(monkeypatch: pytest.MonkeyPatch) -> Any:
    # Holds the background copy until the test opens the gate, so what happens before it is deterministic.
    import threading

    from lightning_par.checkpoint.async_save import _BufferStager

    gate, original = threading.Event(), _BufferStager._copy_later

    def held(copies: Any) -> None:
        assert gate.wait(30)
        original(copies)

    monkeypatch.setattr(_BufferStager, "_copy_later", staticmethod(held))
    return gate


def test_async_saver_copies_optimizer_owned_tensors_in_the_background_until_the_fence(tmp_path, monkeypatch):
    from datetime import timedelta

    from lightning_par.checkpoint.async_save import AsyncSaver

    gate = _gated_staging(monkeypatch)
    saver, path = AsyncSaver(timedelta(seconds=30)), tmp_path / "step=1.ckpt"
    weight, stats = torch.arange(6.0), torch.ones(2)  # a parameter, and a buffer a forward may change
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(path, {"state_dict": {"w": weight, "stats": stats}}, {"global_step": 1}, rank=0,
                   deferred=frozenset({weight.untyped_storage().data_ptr()}))  # fmt: skip
        stats.add_(1.0)  # the next forward: the buffer was copied before save returned
        assert saver._staging is not None and not saver._staging.done()  # the parameter's copy is still to come
        gate.set()
        saver.wait_for_staging()  # what the optimizer's step pre-hook runs
        weight.add_(100.0)  # the optimizer step
        assert saver.wait() == path
    state = _full_state(path)
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0))
    assert torch.equal(state["state_dict"]["stats"], torch.ones(2))


def test_tensor_changed_before_its_background_copy_fails_the_save_not_the_checkpoint(tmp_path, monkeypatch):
    from datetime import timedelta

    from lightning_par.checkpoint import CheckpointError
    from lightning_par.checkpoint.async_save import AsyncSaver

    gate = _gated_staging(monkeypatch)
    saver, path = AsyncSaver(timedelta(seconds=30)), tmp_path / "step=1.ckpt"
    weight = torch.arange(6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(path, {"state_dict": {"w": weight}}, {"global_step": 1}, rank=0,
                   deferred=frozenset({weight.untyped_storage().data_ptr()}))  # fmt: skip
        weight.add_(1.0)  # changed outside an optimizer step, before the copy
        gate.set()
        with pytest.raises(CheckpointError, match=r"step=1.ckpt failed while copying .*state_dict.w was changed in "
                                                  r"place .*wait_for_staging\(\)"):  # fmt: skip
            saver.wait_for_staging()
        with pytest.raises(CheckpointError, match="was not committed"):
            saver.wait()
    assert not path.exists()
