"""``Trainer(strategy="auto_parallel")``: the planner chooses the layout at start-up for the actual model, world and
batch, prints its top three, and the run trains as one process does with the same global batch (fp32: losses 1e-5
relative; AdamW parameters 1e-5 relative + 1 % of the learning rate absolute, docs/testing.md). Whether its choice
is the fastest is measured by benchmarks/bench_auto_parallel.py (docs/planner.md), not here: no timed asserts.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.planner.layout import Layout
from lightning_par.strategies.auto import AutoParallelStrategy, layout_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = {"model": "hf_llama", "strategy": "auto_parallel", "steps": 3, "global_batch": 8}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("auto")
    (got,) = run_jobs(tmp, [JOB], nproc=4, timeout=500)
    chosen: Layout = got["auto"]["chosen"]
    # Each data-parallel rank loads the loader's batch (8 / 4 = 2 samples): the global batch is 2 x the chosen dp.
    (ref,) = run_jobs(tmp, [reference_job({**JOB, "global_batch": 2 * chosen.dp})], nproc=1, timeout=300)
    return got, ref


def test_auto_parallel_trains_the_chosen_layout_like_one_process(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    got, ref = runs
    chosen: Layout = got["auto"]["chosen"]
    layout = got["layout"]
    assert (layout["tp"], layout["pp"], layout["dp_shard"] * layout["dp_replicate"]) == (chosen.tp, chosen.pp,
                                                                                        chosen.dp)  # fmt: skip
    assert layout["zero_stage"] == chosen.zero_stage
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=3e-5)


def test_auto_parallel_prints_its_top_three_and_rules_out_with_reasons(runs: Any) -> None:
    got, _ = runs
    top = got["auto"]["top"]
    assert len(top) == 3 and top[0].startswith("#1 ") and "slower than #1 by its" in top[1]
    assert got["auto"]["n_feasible"] >= 4
    # hf_llama has 4 query / 2 key-value heads and 2 blocks: pp 4 is ruled out, with the fix; tp 4 is not (each
    # key/value head replicated over 2 ranks).
    reasons = set(got["auto"]["ruled_out"])
    assert not any(why.startswith("tp=4") for why in reasons)
    assert "2 blocks cannot fill pp x vpp = 4 stages; lower pp or vpp" in reasons


def test_auto_parallel_refuses_the_layout_arguments_it_chooses() -> None:
    with pytest.raises(ValueError, match=r"auto_parallel chooses \['tp', 'zero_stage'\] itself"):
        AutoParallelStrategy(tp=2, zero_stage=3)
    assert layout_name(Layout(pp=2, tp=2, dp_shard=2, zero_stage=1)) == "pipe_tp_zero1"
    assert layout_name(Layout(dp_shard=4, ep=2)) == "moe"
