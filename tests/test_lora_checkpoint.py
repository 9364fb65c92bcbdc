"""Adapters-only checkpoints (`ParallelStrategy(checkpoint_frozen=False)`): a LoRA fine-tune whose checkpoints leave
out the frozen base, resumed from them plus the same ``pretrained=`` base.

peft's LoRA on a Hugging Face Llama, its base read from a saved folder, trained 4 steps with a checkpoint after every
step under ``zero3`` and ``pipe`` (2 ranks): each checkpoint holds the adapters (and their optimizer state) and no
frozen tensor; resumed from step 2 on the same layout, the run continues the uninterrupted one (losses of steps 3-4
and the final parameters, 1e-5 relative, fp32). Refused, before training, naming the fix: resuming with another base,
and merging such a checkpoint (`--format hf --merge-adapters`: the base is not in it); ``--format peft`` writes its
adapter, which equals the run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import params_close, rel

from lightning_par.checkpoint.reader import CheckpointError, read_index

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("peft")

LAYOUTS = {"zero3": ({"zero_stage": 3}, 2), "pipe": ({"pp": 2}, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from _hf_models import _llama

    tmp = tmp_path_factory.mktemp("lora_ckpt")
    torch.manual_seed(7)
    _llama(2).save_pretrained(tmp / "base")
    torch.manual_seed(8)
    _llama(2).save_pretrained(tmp / "other_base")
    out: dict[str, Any] = {"tmp": tmp}
    for name, (spec, dp) in LAYOUTS.items():
        strategy = {**spec, "pretrained": str(tmp / "base"), "checkpoint_frozen": False}
        base = {"model": "peft_llama", "strategy": strategy, "dp": dp, "steps": 4}
        ckpt = tmp / name
        (full,) = run_jobs(tmp, [{**base, "ckpt_dir": str(ckpt), "ckpt_every_n_steps": 1}], nproc=2, timeout=300)
        step2 = next(p for p in ckpt.iterdir() if "step=2" in p.name)
        resumed, other = run_jobs(tmp, [
            {**base, "resume": str(step2)},
            {**base, "resume": str(step2), "expect_error": True,
             "strategy": {**strategy, "pretrained": str(tmp / "other_base")}},
        ], nproc=2, timeout=300)  # fmt: skip
        out[name] = {"full": full, "resumed": resumed, "other": other, "step2": step2}
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoints_hold_the_adapters_and_no_frozen_weight(runs: dict[str, Any], name: str) -> None:
    keys = [k for k in read_index(runs[name]["step2"]).state_dict_metadata if k.startswith("state_dict.")]
    assert keys and all(".lora_" in k for k in keys), keys
    assert len(keys) == 2 * 7 * 2  # A and B of 7 projections in 2 layers


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_resume_from_adapters_and_the_base_continues_the_run(runs: dict[str, Any], name: str) -> None:
    full, resumed = runs[name]["full"], runs[name]["resumed"]
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 2
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    params_close(resumed["params"], full["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resuming_on_another_base_is_refused(runs: dict[str, Any], name: str) -> None:
    error = runs[name]["other"]["error"]
    assert error is not None and "holds the trained weights only" in error and "pretrained=" in error, error
    assert runs[name]["other"]["losses"] == []


def test_merging_needs_the_base_and_the_adapter_comes_out(runs: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lightning_par.checkpoint.adapters import export_peft
    from lightning_par.checkpoint.export_hf import export_hf

    step2 = runs["zero3"]["step2"]
    with pytest.raises(CheckpointError, match="--format peft"):
        export_hf(step2, tmp_path / "merged", merge_adapters=True)
    export_peft(step2, tmp_path / "adapter")
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 28


def test_deepspeed_refuses_to_leave_out_frozen_weights() -> None:
    import lightning_par

    with pytest.raises(ValueError, match="checkpoint_frozen=False: DeepSpeed writes its own checkpoints"):
        lightning_par.DeepSpeedParallelStrategy(zero_stage=1, checkpoint_frozen=False)
