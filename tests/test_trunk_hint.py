"""The trunk named by the user (``ParallelStrategy(trunk="blocks")``), where `find_trunk` picks another container.

A user model with two stacks run one after the other (tests/_job_models.py, ``TwoStacksLM``): ``front`` (3 blocks,
the larger, the finder's pick) and ``blocks`` (2). One 2-rank spawn against one process (losses 1e-5 relative,
parameters rtol 1e-5 / atol 1e-7): ZeRO-3 wraps the named stack's blocks as its units, and a pipeline cuts the named
stack (``front`` then runs on the first stage, before it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launch import run_jobs
from parity import params_close, rel

from lightning_par import ParallelStrategy
from lightning_par.blocks.trunk import named_trunk

MODEL = "two_stacks_lm"
JOBS: dict[str, dict[str, Any]] = {
    "zero3": {"strategy": {"zero_stage": 3}, "dp": 2},
    "zero3_named": {"strategy": {"zero_stage": 3, "trunk": "blocks"}, "dp": 2},
    "pipe": {"strategy": {"pp": 2}, "dp": 1},
    "pipe_named": {"strategy": {"pp": 2, "trunk": "blocks"}, "dp": 1},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("trunk_hint")
    (ref,) = run_jobs(tmp, [{"model": MODEL, "strategy": "auto"}], nproc=1, timeout=300)
    got = run_jobs(tmp, [{"model": MODEL, **j} for j in JOBS.values()], nproc=2, timeout=400)
    return {"ref": ref, **dict(zip(JOBS, got, strict=True))}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_every_layout_trains_as_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs[name], runs["ref"]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_named_stack_is_what_zero3_wraps_and_the_pipeline_cuts(runs: dict[str, Any]) -> None:
    def units(name: str) -> set[str]:  # the units that hold one block each (the root holds the rest)
        blocks = [{".".join(p.split(".")[:2]) for p in unit} for unit in runs[name]["fsdp_unit_params"][0]]
        return {b.pop() for b in blocks if len(b) == 1}

    assert units("zero3") == {"front.0", "front.1", "front.2"}
    assert units("zero3_named") == {"blocks.0", "blocks.1"}
    # Parameter tensors per stage (6 per block, the embedding 1, the final norm and head 4). Named: the first stage
    # holds the embedding, all of front and blocks.0, the last blocks.1; the finder's cut is inside front: the first
    # stage holds front.0-1, the last front.2 and both named blocks (run after its trunk).
    assert runs["pipe_named"]["param_counts_all"] == [1 + 18 + 6, 6 + 4]
    assert runs["pipe"]["param_counts_all"] == [1 + 12, 6 + 12 + 4]


def test_a_trunk_that_names_no_container_is_refused_listing_the_containers() -> None:
    from _job_models import MODELS

    with pytest.raises(ValueError, match=r"trunk='head' is not a ModuleList .* containers of several modules: "
                                         r"front, blocks"):  # fmt: skip
        named_trunk(MODELS[MODEL](), "head")
    with pytest.raises(ValueError, match="must be a module's qualified name"):
        ParallelStrategy(trunk="")
