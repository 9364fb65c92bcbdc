"""Every recipe parses with the real LightningCLI and builds what it says; the demo command runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT, worker_env

import lightning_par
from lightning_par.cli import build_cli

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
EXPECTED = {  # recipe -> (zero_stage, offload, dp_replicate, tp)
    "demo": (2, False, 1, 1),
    "zero1": (1, False, 1, 1),
    "zero2": (2, False, 1, 1),
    "zero3": (3, False, 1, 1),
    "zero3_offload": (3, True, 1, 1),
    "hybrid_zero3": (3, False, 2, 1),
    "tp": (0, False, 1, 2),
    "tp_zero3": (3, False, 1, 2),
    "moe": (2, False, 1, 1),
    "cp_zero3": (3, False, 1, 1),
}
CP = {"cp_zero3": (2, "ulysses")}  # recipe -> (cp, cp_mode); every other recipe has cp 1


def test_every_recipe_is_covered():
    assert {r.stem for r in RECIPES} == set(EXPECTED)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_parses_and_builds(recipe: Path, tmp_path, monkeypatch):
    lines = recipe.read_text().splitlines()
    command = lines[0]
    for line in lines[1:]:  # a long command continues with a trailing backslash
        if not command.endswith("\\"):
            break
        command += line
    assert command.startswith("# ") and f"recipes/{recipe.name}" in command, "a recipe opens with its launch command"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(sys, "argv", ["lightning-par"])  # not pytest's own arguments
    cli = build_cli(["--config", str(recipe)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lightning_par.ParallelStrategy)
    c = strategy.config
    assert (c.zero_stage, c.offload, c.dp_replicate, c.tp) == EXPECTED[recipe.stem]
    assert (c.cp, c.cp_mode) == CP.get(recipe.stem, (1, "allgather"))
    assert type(cli.model).__module__.startswith("lightning_par.models")
    assert type(cli.datamodule).__name__ == "ByteTextDataModule"
    assert isinstance(cli.trainer.precision_plugin, lightning_par.ParallelPrecision)


def test_demo_command_trains_and_logs_to_wandb_offline(tmp_path):
    """The README's demo command (shortened): 2 processes started by Lightning, zero2, an offline W&B run."""
    env = worker_env()
    env.pop("WANDB_MODE", None)  # the CLI must choose offline by itself when there is no API key
    env.pop("WANDB_API_KEY", None)
    demo = str(ROOT / "recipes" / "demo.yaml")
    cmd = [sys.executable, "-m", "lightning_par.cli", "fit", "--config", demo, "--trainer.max_steps=4",
           "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, os.listdir(tmp_path)
    assert list(runs[0].glob("run-*.wandb")), "the offline run has its log file"
    layout = "lightning_par layout: world 2 = pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1"
    assert layout in proc.stdout + proc.stderr


def test_plan_command_prints_the_inferred_plan(tmp_path):
    """``lightning-par plan --config recipes/tp.yaml``: the real console entry point, no processes started."""
    cmd = [sys.executable, "-m", "lightning_par.cli", "plan", "--config", str(ROOT / "recipes" / "tp.yaml")]
    proc = subprocess.run(cmd, env=worker_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "transformer.h.*.attn.c_attn" in out and "colwise_fused_qkv" in out
    assert "transformer.h.*.mlp.c_proj" in out and "rowwise" in out
    assert "n_heads=4 n_kv_heads=4" in out and "valid for tp=2" in out
