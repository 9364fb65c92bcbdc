"""`lightning-par sweep`: Optuna trials of a recipe end to end on CPU, pruning, W&B groups, and bad spaces.

One sweep of 3 trials of a 2-rank ZeRO-2 recipe (6 steps, validation at steps 3 and 6; ~1 minute here): two enqueued
learning rates that train, then lr = 50, whose validation loss at step 3 is far above the median of the first two,
so Optuna's median pruner stops it there. The trials' W&B runs (offline) are read back with wandb's own reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launch import run_session, worker_env

from lightning_par.tuning.space import SpaceError, load_space

pytestmark = pytest.mark.slow  # trial processes, ~1-2 minutes: the slow tier (README)

RECIPE = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu", "devices": 2, "strategy": "zero2", "max_steps": 6, "val_check_interval": 3,
        "limit_val_batches": 2, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "num_sanity_val_steps": 0,
        "logger": {"class_path": "lightning.pytorch.loggers.WandbLogger",
                   "init_args": {"project": "sweep-test", "offline": True}},
    },
    "model": {"class_path": "lightning_par.models.GPT",
              "init_args": {"vocab_size": 256, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32, "lr": 0.003}},
    "data": {"class_path": "lightning_par.data.ByteTextDataModule",
             "init_args": {"seq_len": 32, "batch_size": 4, "num_samples": 64}},
}  # fmt: skip
SPACE = {
    "metric": "val_loss",
    "trials": 3,
    "parameters": {"model.init_args.lr": {"low": 1.0e-4, "high": 100.0, "log": True}},
    "enqueue": [{"model.init_args.lr": 0.003}, {"model.init_args.lr": 0.002}, {"model.init_args.lr": 50.0}],
}


def sweep_command(tmp: Path, space: dict, *extra: str) -> list[str]:
    """Write `RECIPE` (W&B logging into ``tmp``) and ``space`` into ``tmp``; the `lightning-par sweep` command over
    them, to run in ``tmp`` (also tests/test_sweep_ray.py's)."""
    recipe = dict(RECIPE, trainer={**RECIPE["trainer"], "logger": {**RECIPE["trainer"]["logger"]}})
    recipe["trainer"]["logger"]["init_args"] = {**RECIPE["trainer"]["logger"]["init_args"], "save_dir": str(tmp)}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (tmp / "space.yaml").write_text(yaml.safe_dump(space))
    return [str(Path(sys.executable).with_name("lightning-par")), "sweep", "--config", "recipe.yaml", "--space",
            "space.yaml", "--out", "out", *extra]  # fmt: skip


def _sweep(tmp: Path, space: dict, *extra: str) -> subprocess.CompletedProcess:
    cmd = sweep_command(tmp, space, *extra)
    env = {**worker_env(), "WANDB_MODE": "offline"}
    return run_session(cmd, cwd=tmp, env=env, timeout=600)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("sweep")
    return tmp, _sweep(tmp, SPACE, "--study-name", "lr-study")


def test_a_sweep_runs_trials_and_prunes_the_diverging_one(sweep):
    tmp, done = sweep
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp / "out" / "results.json").read_text())
    assert results["study"] == "lr-study" and results["metric"] == "val_loss"
    states = [t["state"] for t in results["trials"]]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert [t["params"]["model.init_args.lr"] for t in results["trials"]] == [0.003, 0.002, 50.0]
    # Complete trials reported both validations; the pruned one was stopped after its first.
    assert [t["steps"] for t in results["trials"]] == [[3, 6], [3, 6], [3]]
    # (Each complete trial's value is the val_loss its own run logged: test_the_trials_are_one_wandb_group.)
    assert "best: trial" in done.stdout and "| 2 | pruned |" in done.stdout


def test_the_trials_are_one_wandb_group(sweep):
    tmp, done = sweep
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp / "wandb").glob("offline-run-*"))
    assert len(runs) == 3
    seen = []
    for run in runs:
        reader = [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run)]
        read = subprocess.run(reader, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert read.returncode == 0, read.stderr[-2000:]
        records = [json.loads(line) for line in read.stdout.splitlines()]
        header = [r["run"] for r in records if r.get("type") == "run"]
        if not header:  # the pruned trial was stopped (its W&B service with it) and may not have flushed its run
            continue
        history = [r["history"]["item"] for r in records if r.get("type") == "history"]
        val = [h["val_loss"] for h in history if "val_loss" in h]
        seen.append((header[0]["run_group"], header[0]["display_name"], val[-1] if val else None))
    # Both complete trials are read back, with their validation losses; every run read is the study's group; what
    # the study recorded as each complete trial's value is the last val_loss its run logged.
    trials = json.loads((tmp / "out" / "results.json").read_text())["trials"]
    logged = {name: value for _, name, value in seen}
    for i in (0, 1):
        assert logged[f"lr-study-{i}"] == pytest.approx(trials[i]["value"], rel=1e-6), (i, logged, trials[i])
    assert all(group == "lr-study" and name.startswith("lr-study-") for group, name, _ in seen)


PBT = {
    "metric": "val_loss", "algorithm": "pbt", "population": 2, "generations": 2, "steps_per_generation": 3,
    "quantile": 0.5, "seed": 4,
    "parameters": {"model.init_args.lr": {"low": 1.0e-4, "high": 1.0e-1, "log": True},
                   "trainer.strategy": {"choices": ["zero1", "zero3"]}},
}  # fmt: skip


def test_population_based_training_exploits_and_explores_from_checkpoints(tmp_path):
    # 2 members x 2 generations of 3 steps (validation at each generation's end). After generation 0 the worse
    # member continues the better one's checkpoint with its lr perturbed, the better one its own. Seed 4 draws
    # zero1 for one member and zero3 for the other, so the exploiting member's resume is resharded.
    done = _sweep(tmp_path, PBT, "--study-name", "pbt-study")
    assert done.returncode == 0, done.stderr[-3000:]
    members = json.loads((tmp_path / "out" / "results.json").read_text())["members"]
    assert {m["history"][0]["values"]["trainer.strategy"] for m in members} == {"zero1", "zero3"}
    first = {m["id"]: m["history"][0] for m in members}
    second = {m["id"]: m["history"][1] for m in members}
    best = min(first, key=lambda i: first[i]["score"])
    worst = max(first, key=lambda i: first[i]["score"])
    assert all(h["start_step"] == 3 for h in second.values())  # every member resumed a checkpoint after 3 steps
    for i, h in second.items():
        if i == worst:
            assert h["exploited"] == best and h["resumed"] == first[best]["saved"]
            factor = h["values"]["model.init_args.lr"] / first[best]["values"]["model.init_args.lr"]
            assert min(abs(factor - 0.8), abs(factor - 1.2)) < 1e-9
        else:
            assert h["exploited"] is None and h["resumed"] == first[i]["saved"]
            assert h["values"] == first[i]["values"]
        # The run started with its own lr, not the one the restored optimizer state held.
        assert h["lr_at_start"] == pytest.approx(h["values"]["model.init_args.lr"])
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 4


def test_an_argument_the_recipe_lacks_fails_before_any_trial(tmp_path):
    space = {"parameters": {"model.init_args.learning_rate": {"low": 1.0e-4, "high": 1.0e-2}}, "trials": 2}
    done = _sweep(tmp_path, space)
    assert done.returncode != 0
    assert "has no argument model.init_args.learning_rate" in done.stderr
    assert "--print_config" in done.stderr
    assert not (tmp_path / "out" / "trial-0.log").exists()


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"trials": 2}, "needs a 'parameters' mapping"),
        ({"parameters": {"a": {"low": 1, "high": 1}}}, "a range needs numbers low < high"),
        ({"parameters": {"a": {"low": 0.0, "high": 1.0, "log": True}}}, "a log range needs low > 0"),
        ({"parameters": {"a": {"choices": []}}}, "'choices' must be a non-empty list"),
        ({"parameters": {"a": {"choices": [1]}}, "sampler": "cmaes"}, "sampler must be one of"),
        ({"parameters": {"a": {"choices": [1]}}, "enqueue": [{"b": 1}]}, "enqueue names ['b']"),
        ({"parameters": {"a": {"choices": [1]}}, "metrics": "x"}, "unknown entries ['metrics']"),
        ({"parameters": {"a": {"choices": [1]}}, "algorithm": "pbt"}, "pbt needs steps_per_generation >= 1"),
        ({"parameters": {"a": {"choices": [1]}}, "algorithm": "hyperband"}, "use optuna \\(default\\) or pbt"),
    ],
)
def test_bad_spaces_are_refused_naming_the_fix(tmp_path, space, message):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    with pytest.raises(SpaceError, match=message.replace("[", r"\[").replace("]", r"\]").replace("'", "'")):
        load_space(path)


def test_overrides_are_command_line_arguments():
    space = load_space_from({"parameters": {"trainer.strategy": {"choices": ["zero1"]}}})
    assert space.overrides({"trainer.strategy": "zero1", "model.init_args.lr": 0.003, "x.y": [1, 2]}) == [
        "--trainer.strategy=zero1", "--model.init_args.lr=0.003", "--x.y=[1, 2]"]  # fmt: skip


def load_space_from(raw: dict):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "space.yaml"
        path.write_text(yaml.safe_dump(raw))
        return load_space(path)
