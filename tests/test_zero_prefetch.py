"""ZeRO-1/2's parameter all-gather after the optimizer step, overlapped with the next forward (`zero.prefetch`).

One 2-rank spawn and one reference process. The model has uneven shards (vocabulary 258, 34 positions over 2
ranks) and a tied head. Checked against one process (fp32: losses 1e-5 relative; weights 1e-5 relative and
0.01 x lr absolute, as tests/test_zero.py: AdamW moves a weight whose gradient is near zero by up to lr, so the
data-parallel average's reduction order shows there, measured 2.6e-6 with or without the deferral):

- with no user code between step and forward, the gather is deferred at every step, on a process group of its
  own, and each block waits for its weights in its forward pre-hook (counted), and training is unchanged, under
  ZeRO-1 and under ZeRO-2 with gradient accumulation, and on models we did not write (Hugging Face's Llama under
  ZeRO-1, litgpt's Llama-layout GPT under ZeRO-2; SGD + momentum there, parameters 1e-5 / 1e-7);
- the contract: an EMA callback reading the weights in ``on_train_batch_end`` sees the new weights (the strategy
  waits before it, nothing is left to wait for in the forward); an optimizer step post-hook of the user's sees
  them (the gather is then not deferred);
- a ``training_step`` that reads a block's weight before the forward is caught on the first deferred step: it
  reads complete weights, a warning names the fix, and the deferral is off for the run.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

STEPS = 4
ATOL = 0.01 * 3e-3  # 0.01 x the model's learning rate (gpt_quiet's and hf_llama's AdamW)
SGD_ATOL = 1e-7  # the families' SGD + momentum (tests/test_families.py)
# Trunk blocks per model, one unit each, plus one for everything outside them (embeddings, final norm, head).
BLOCKS = {"gpt_quiet": 3, "hf_llama": 2, "litgpt_llama": 4}
JOBS: dict[str, dict[str, Any]] = {
    "zero1": {"model": "gpt_quiet", "strategy": "zero1", "quiet": True},
    "zero2_accumulate": {"model": "gpt_quiet", "strategy": "zero2", "quiet": True, "accumulate": 2},
    # Models we did not write: Hugging Face's LlamaForCausalLM from a config, litgpt's GPT (Llama layout).
    "hf_llama_zero1": {"model": "hf_llama", "strategy": "zero1", "quiet": True},
    "litgpt_llama_zero2": {"model": "litgpt_llama", "strategy": "zero2", "quiet": True},
    "ema": {"model": "gpt_quiet", "strategy": "zero1", "quiet": True, "ema": True},
    "post_hook": {"model": "gpt_post_hook", "strategy": "zero2", "quiet": True},
    "read_early": {"model": "gpt_read_early", "strategy": "zero2", "quiet": True, "record_warnings": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prefetch")
    jobs = [{**job, "steps": STEPS} for job in JOBS.values()]
    got = dict(zip(JOBS, run_jobs(tmp / "two", jobs, nproc=2, timeout=300), strict=True))
    refs = [reference_job({k: v for k, v in job.items() if k != "record_warnings"}) for job in jobs]
    ref = dict(zip(JOBS, run_jobs(tmp / "one", refs, nproc=1, timeout=300), strict=True))
    return got, ref


@pytest.mark.parametrize("case", list(JOBS))
def test_training_matches_one_process(runs: tuple[dict[str, Any], dict[str, Any]], case: str) -> None:
    got, ref = runs[0][case], runs[1][case]
    assert len(got["losses"]) == STEPS
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=SGD_ATOL if case.startswith("litgpt") else ATOL)


@pytest.mark.parametrize("case", ["zero1", "zero2_accumulate", "hf_llama_zero1", "litgpt_llama_zero2"])
def test_gather_is_waited_for_in_the_forward(runs: tuple[dict[str, Any], dict[str, Any]], case: str) -> None:
    stats = runs[0][case]["prefetch"]
    blocks = BLOCKS[JOBS[case]["model"]]
    assert stats["enabled"] and stats["units"] == blocks + 1
    # dp_shard is the default group here: the gather runs on a group of its own over the same ranks, so Lightning's
    # per-batch broadcast on the default group does not queue behind it (collectives.apart_from_default).
    assert not stats["default_group"] and stats["group_ranks"] == [0, 1]
    assert stats["deferred"] == STEPS  # every step's gather started and returned
    # Steps 2..STEPS each start with the previous step's gather in flight: every block waits in its pre-hook.
    assert stats["waited_in_forward"] == (STEPS - 1) * blocks


def test_ema_callback_sees_the_new_weights(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    got, ref = runs[0]["ema"], runs[1]["ema"]
    params_close(got["ema"], ref["ema"], rtol=1e-5, atol=ATOL)
    stats = got["prefetch"]
    assert stats["deferred"] == STEPS and stats["waited_in_forward"] == 0  # waited before the callback instead


def test_step_post_hook_sees_the_new_weights(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    got, ref = runs[0]["post_hook"], runs[1]["post_hook"]
    assert len(got["probe"]["after_step"]) == STEPS
    assert rel(got["probe"]["after_step"], ref["probe"]["after_step"]) < 1e-6
    assert got["prefetch"]["deferred"] == 0


def test_weight_read_before_the_forward_is_caught(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    got, ref = runs[0]["read_early"], runs[1]["read_early"]
    assert rel(got["probe"]["early"], ref["probe"]["early"]) < 1e-6
    stats = got["prefetch"]
    assert not stats["enabled"] and stats["deferred"] == 1
    assert any("wait_for_params" in w and "no longer overlaps" in w for w in got["warnings"]), got["warnings"]
