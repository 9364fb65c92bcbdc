"""The job description (tests/jobs.py): a misspelled option fails, naming it and the option meant, in the test process
before any rank starts; every option the suite's jobs use is a field; and every field is read by the worker."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from conftest import PARITY_JOBS, reference_job
from jobs import FIELDS, Job, UnknownJobKey, check
from launch import run_jobs

HERE = Path(__file__).parent


def test_a_misspelled_key_fails_naming_it_and_the_closest_field():
    with pytest.raises(UnknownJobKey, match=r"unknown job key 'stesp'; did you mean 'steps'\?"):
        Job.from_dict({"model": "gpt", "stesp": 4})
    with pytest.raises(UnknownJobKey) as caught:  # every unknown key is named, not only the first
        check([{"model": "gpt"}, {"model": "gpt", "ckpt_every_n_step": 1, "zzz": True}])
    assert "'ckpt_every_n_step'; did you mean 'ckpt_every_n_steps'?" in str(caught.value)
    assert "unknown job key 'zzz'" in str(caught.value)


@pytest.mark.parametrize("nproc", [1, 2])
def test_run_jobs_refuses_a_misspelled_key_before_any_rank_starts(tmp_path, nproc):
    with pytest.raises(UnknownJobKey, match="'strategi'; did you mean 'strategy'"):
        run_jobs(tmp_path, [{"model": "gpt", "strategi": "zero1"}], nproc=nproc)
    assert not list(tmp_path.glob("*.json"))  # no spec written, nothing launched


def test_the_parity_jobs_and_their_references_are_jobs():
    for job in PARITY_JOBS.values():
        for described in (job, reference_job(job)):
            built = Job.from_dict(described)
            assert {k: getattr(built, k) for k in described} == described


def test_the_defaults_are_the_workers():
    job = Job.from_dict({})
    assert job == Job()
    assert (job.model, job.strategy, job.precision, job.seed) == ("gpt", "auto", "32-true", 0)
    assert (job.steps, job.global_batch, job.seq_len, job.accumulate, job.num_nodes) == (3, 8, 32, 1, 1)
    assert (job.save_top_k, job.save_last, job.limit_val_batches, job.num_sanity_val_steps) == (-1, False, 2, 0)
    assert (job.workers, job.stream_dir) == (0, ".")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.steps = 4  # type: ignore[misc]


def test_every_field_is_read_by_the_worker():
    # A field nothing reads would be an option silently ignored again: each must appear as ``job.<field>``.
    read: set[str] = set()
    for name in ("_worker.py", "_job_hooks.py", "_local_sgd_sim.py"):
        for node in ast.walk(ast.parse((HERE / name).read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "job":
                read.add(node.attr)
    assert sorted(FIELDS - read) == []
    assert sorted(read - FIELDS) == []
