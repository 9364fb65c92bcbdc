"""Deterministic resume: N steps, save, resume, the rest == the uninterrupted run, bit for bit (fp32, CPU).

Design: a GPT with dropout 0.1 whose training_step also draws from Python's `random` and NumPy
(`_job_models.DropoutGPT`), every rank seeded differently (``rank_seed``), 3 steps per epoch over a 24-sample set
(Lightning's shuffling DistributedSampler: every epoch has its own order), 8 steps (``max_steps``), a checkpoint after
every step and one at every epoch's end. Each resume starts from one of them and must reproduce the uninterrupted run's
remaining losses, parameters, rank 0's batches and its Python / NumPy draws exactly: the data position, each rank's RNG
states, the model and the optimizer state are all restored, and the resumed run does the same operations in the same
order. Save points: mid-epoch (after batch 1 or 2 of epoch 1), at the last batch of an epoch (``on_train_batch_end``),
and at an epoch's end (``on_train_epoch_end``; Lightning's own resume from there shuffles the next epoch one epoch
ahead). ZeRO-2 with synchronous saves, ZeRO-3 with asynchronous ones, a run by max_epochs without validation, and one
with gradient accumulation (2 micro-batches per step).

On another world size (2 -> 4 ranks, same global batch) the data order carries over; the model without dropout must
continue the 2-rank loss curve to fp32 tolerance (1e-5 relative, as tests/test_zero.py: a different summation
order). RNG streams cannot be resharded (docs/checkpointing.md), so that case uses no dropout.

Spawns: one 2-rank torchrun (5 writers, 8 resumes; ~50 s here) and one 4-rank torchrun (~10 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs

STEPS, EPOCH_STEPS = 8, 3
# Validation (one batch) at every epoch's end: see the module docstring of resume_state.py for why an epoch-end
# checkpoint of a max_steps run needs it. The "epochs" writer trains by max_epochs without validation instead.
BASE: dict[str, Any] = {"epoch_steps": EPOCH_STEPS, "max_steps": STEPS, "limit_val_batches": 1}
BY_EPOCHS: dict[str, Any] = {"max_steps": -1, "max_epochs": 3, "limit_val_batches": 0}
# Writers: name -> (model, strategy, overrides); each trains uninterrupted and keeps every checkpoint.
WRITERS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "zero2": ("gpt_dropout", {"zero_stage": 2}, {}),
    "zero3_async": ("gpt_dropout", {"zero_stage": 3, "async_save": True}, {}),
    "no_dropout_zero3": ("gpt", "zero3", {}),
    "zero3_by_epochs": ("gpt_dropout", "zero3", BY_EPOCHS),
    # Two micro-batches per step: Lightning counts the position in micro-batches.
    "zero2_accumulate": ("gpt_dropout", {"zero_stage": 2}, {"accumulate": 2}),
}
# Resumes on 2 ranks: name -> (writer, checkpoint folder relative to the writer's root, global step it holds).
RESUMES: dict[str, tuple[str, str, int]] = {
    "zero2_mid_epoch": ("zero2", "steps/step=4.ckpt", 4),
    "zero2_last_batch": ("zero2", "steps/step=6.ckpt", 6),
    "zero2_epoch_end": ("zero2", "epochs/epoch=0.ckpt", 3),
    "zero3_async_mid_epoch": ("zero3_async", "steps/step=5.ckpt", 5),
    "zero3_async_epoch_end": ("zero3_async", "epochs/epoch=1.ckpt", 6),
    "zero3_by_epochs_epoch_end": ("zero3_by_epochs", "epochs/epoch=0.ckpt", 3),
    "zero3_by_epochs_mid_epoch": ("zero3_by_epochs", "steps/step=7.ckpt", 7),
    "zero2_accumulate_mid_epoch": ("zero2_accumulate", "steps/step=4.ckpt", 4),
}
RESHARD = ("no_dropout_zero3", "steps/step=4.ckpt", 4)  # resumed on 4 ranks with zero3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("resume")
    jobs: dict[str, dict[str, Any]] = {}
    for name, (model, strategy, over) in WRITERS.items():
        root = tmp / name
        jobs[name] = {**BASE, **over, "model": model, "strategy": strategy, "rank_seed": True,
                      "ckpt_dir": str(root / "steps"), "ckpt_every_n_steps": 1,
                      "ckpt_epoch_end_dir": str(root / "epochs")}  # fmt: skip
    for name, (writer, folder, _) in RESUMES.items():
        model, strategy, over = WRITERS[writer]
        resume = str(tmp / writer / folder)
        jobs[name] = {**BASE, **over, "model": model, "strategy": strategy, "rank_seed": True, "resume": resume}
    results = dict(zip(jobs, run_jobs(tmp / "s2", list(jobs.values()), nproc=2, timeout=400), strict=True))
    writer, folder, _ = RESHARD
    reshard = {**BASE, "model": "gpt", "strategy": "zero3", "rank_seed": True, "resume": str(tmp / writer / folder)}
    (results["reshard_2_to_4"],) = run_jobs(tmp / "s4", [reshard], nproc=4, timeout=300)
    return {"root": tmp, **results}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_continues_the_uninterrupted_run_bit_for_bit(runs, case):
    writer, _, step = RESUMES[case]
    full, resumed = runs[writer], runs[case]
    micro = WRITERS[writer][2].get("accumulate", 1)  # records are per micro-batch
    assert len(full["losses"]) == (9 if writer == "zero3_by_epochs" else STEPS) * micro
    assert resumed["start_step"] == step
    done = step * micro
    # The same samples (rank 0's share), in the same order, from the next unseen one.
    assert resumed["batch_heads"] == full["batch_heads"][done:]
    assert resumed["losses"] == full["losses"][done:]  # dropout masks equal: each rank's torch RNG restored
    assert resumed["draws"] == full["draws"][done:]  # Python's random and NumPy restored (rank 0)
    assert resumed["params"].keys() == full["params"].keys()
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.slow
def test_the_setup_is_sensitive_to_what_is_restored(runs):
    full = runs["zero2"]
    # Every epoch has its own order (a resume that restarted the epoch or reseeded it would see other batches).
    epochs = [sorted(map(tuple, full["batch_heads"][i : i + EPOCH_STEPS])) for i in range(0, STEPS, EPOCH_STEPS)]
    assert epochs[0] != epochs[1] and epochs[1][:2] != epochs[2]
    # Dropout is on: the same data and weights give different losses with another RNG state.
    assert full["losses"] != runs["no_dropout_zero3"]["losses"]
    # Ranks draw different numbers (per-rank seeds): restoring rank 0's streams on rank 1 would show.
    assert len({d for d in full["draws"]}) == STEPS


@pytest.mark.slow
def test_each_rank_saves_its_rng_states_and_the_position_is_global(runs):
    from lightning_par.checkpoint.reader import read_meta
    from lightning_par.checkpoint.resume_state import KEY, read_rank_state

    folder: Path = runs["root"] / "zero2" / "steps" / "step=4.ckpt"
    states = [read_rank_state(folder, r) for r in range(2)]
    assert all(s is not None for s in states)
    assert not torch.equal(states[0]["rng"]["torch"], states[1]["rng"]["torch"])  # type: ignore[index]
    resume = read_meta(folder)[KEY]
    assert resume["world_size"] == 2
    (position,) = resume["data"]
    # After batch 1 of epoch 1: one global batch of 8 samples of that epoch's order.
    assert position == {"epoch": 1, "samples": 8, "complete": False, "seed": 0, "shuffle": True, "dataset_len": 24}
    epoch_end = read_meta(runs["root"] / "zero2" / "epochs" / "epoch=0.ckpt")[KEY]["data"][0]
    assert epoch_end["epoch"] == 0 and epoch_end["complete"] and epoch_end["samples"] == 24


@pytest.mark.slow
def test_resume_on_4_ranks_continues_the_2_rank_loss_curve(runs):
    writer, _, step = RESHARD
    full, resumed = runs[writer], runs["reshard_2_to_4"]
    assert resumed["layout"]["world_size"] == 4 and resumed["start_step"] == step
    assert len(resumed["losses"]) == STEPS - step
    rel = max(abs(a - b) / abs(b) for a, b in zip(resumed["losses"], full["losses"][step:], strict=True))
    assert rel < 1e-5, rel


# ---- unit: the sampler's resharding rule and the RNG round trip, no process group ---------------------------------
def _pass(replicas: int, rank: int, start: tuple[int, int] | None = None, epoch: int = 1) -> list[int]:
    from torch.utils.data import DistributedSampler

    from lightning_par.checkpoint.resume_state import ResumableSampler

    sampler = ResumableSampler(DistributedSampler(range(24), replicas, rank, seed=0), lambda: epoch)
    if start is not None:
        sampler.start_at(*start)
    return list(sampler)


def test_a_position_carries_over_to_another_number_of_replicas():
    order = _pass(1, 0)  # epoch 1's order
    assert order != _pass(1, 0, epoch=0) and sorted(order) == list(range(24))
    # 8 samples consumed (one global batch of 8 on 2 ranks); on 4 ranks with 2 samples each per step, every step's
    # global batch is the same set as the uninterrupted run's.
    rest = [_pass(4, r, start=(1, 8)) for r in range(4)]
    for step in range(2):  # a global batch of 8
        got = sorted(i for r in range(4) for i in rest[r][2 * step : 2 * step + 2])
        assert got == sorted(order[8 + 8 * step : 16 + 8 * step])
    assert _pass(2, 0) == order[0::2]  # without a start: the plain DistributedSampler order of the epoch


def test_a_position_that_does_not_divide_fails_with_the_fix():
    with pytest.raises(ValueError, match=r"after 6 samples of epoch 1, which do not divide over 4 data-parallel"):
        _pass(4, 0, start=(1, 6))


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    from lightning_par.checkpoint.resume_state import rng_state, set_rng_state

    def draw() -> tuple:
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.save(rng_state(torch.device("cpu")), tmp_path / "rng.pt")
    first = draw()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), torch.device("cpu"))
    assert draw() == first
