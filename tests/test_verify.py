"""`lightning-par verify` (lightning_par/cli_verify.py): a user's recipe trained under a layout and under one process,
compared step by step.

- A Hugging Face Llama built from a config (``lightning_par.models.HFCausalLM``, AdamW) under ``tp`` on 2
  processes: the verdict is SAME, every step's loss and gradient norm within 1e-5, no parameter beyond the bound.
- A deliberately broken layout (tests/_broken_strategy.py: ZeRO-0 whose reduction leaves out one parameter): the
  verdict is DIFFERENT and names that parameter, at step 1, as the first to diverge; the command exits 1.
- Bad input, before any run: an unknown strategy name lists the close ones; a model that does not fit the reference
  says so and proposes the closest reference that fits (``zero3``), or says that none fits.

Spawns: the two verifications, each two Lightning runs (1 and 2 processes) started by the command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_par.cli_verify import VerifyError, verify

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _recipe(tmp: Path) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config.save_pretrained(tmp / "llama")
    recipe = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "zero1", "precision": "32-true"},
        "model": {"class_path": "lightning_par.models.HFCausalLM",
                  "init_args": {"config": str(tmp / "llama"), "lr": 0.003}},
        "data": {"class_path": "lightning_par.data.ByteTextDataModule", "init_args": {"seq_len": 32, "batch_size": 4}},
    }  # fmt: skip
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _verify(recipe: Path, strategy: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lightning_par.cli", "verify", "--config", str(recipe), "--strategy", strategy,
           "--steps", "2", "--devices", "2", "--out", str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_a_hugging_face_model_under_tp_trains_as_one_process(tmp_path: Path) -> None:
    done = _verify(_recipe(tmp_path), "tp", tmp_path / "runs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2, done.stdout
    assert "verdict: SAME" in done.stdout
    saved = sorted(p.name for p in (tmp_path / "runs" / "layout").glob("step=*"))
    assert saved == ["step=1", "step=2"]  # the whole states, in verify's own folder


@pytest.mark.slow
def test_a_dropped_reduction_is_named_as_the_first_difference(tmp_path: Path) -> None:
    from _broken_strategy import DROPPED

    done = _verify(_recipe(tmp_path), "_broken_strategy.DropOneReduction", tmp_path / "runs")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"verdict: DIFFERENT: first at step 1: parameter {DROPPED} (" in done.stdout, done.stdout


def test_an_unknown_strategy_lists_the_close_names(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match=r"unknown strategy 'zer03'; did you mean 'zero3'"):
        verify(str(_recipe(tmp_path)), "zer03")


def test_a_model_too_large_for_the_reference_proposes_one_that_fits(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    recipe = str(_recipe(tmp_path))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "llama"))
    params_gib = 16 * sum(p.numel() for p in model.parameters()) / 2**30  # 16 bytes a parameter (Adam, fp32)
    with pytest.raises(VerifyError, match=r"use --reference zero3 .* the closest that fits"):
        verify(recipe, "tp", memory_gib=params_gib * 0.6)  # half of it (zero3 on 2) fits, all of it does not
    with pytest.raises(VerifyError, match=r"no reference fits: even zero3 on 2 processes"):
        verify(recipe, "tp", memory_gib=params_gib * 0.1)
