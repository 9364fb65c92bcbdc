"""`lightning-par sweep` with ``backend: ray``: Ray Tune trials end to end on CPU, and the refusals that need no Ray.

The end-to-end sweep (slow tier) is the Optuna test's (tests/test_sweep.py) on a local Ray instance that the command
starts: a 2-rank ZeRO-2 recipe (so each trial asks Ray for 2 CPUs), 4 trials one at a time (``max_concurrent: 1``,
so the median rule sees the same history on any machine): lr 0.003 and 0.002 train; lr = 50 is stopped by Ray's
median stopping rule at its first validation, far above the first two; n_head = 3 crashes (it does not divide the
width, 32) and is recorded as failed while the sweep goes on. ~1-2 minutes here. No part of Ray is mocked.
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
from test_sweep import sweep_command

from lightning_par.cli import sweep_main
from lightning_par.tuning.ray_tune import require_ray, run_ray_sweep, trial_resources
from lightning_par.tuning.space import SpaceError, load_space

LR, HEADS = "model.init_args.lr", "model.init_args.n_head"
SPACE = {
    "metric": "val_loss", "trials": 4, "backend": "ray", "max_concurrent": 1,
    "parameters": {LR: {"low": 1.0e-4, "high": 100.0, "log": True}, HEADS: {"choices": [2, 3]}},
    "enqueue": [{LR: 0.003, HEADS: 2}, {LR: 0.002, HEADS: 2}, {LR: 50.0, HEADS: 2}, {LR: 0.003, HEADS: 3}],
}  # fmt: skip
_TIMEOUT_S = 400


def _sweep(tmp: Path, space: dict, *extra: str) -> subprocess.CompletedProcess:
    # A session of its own, so a sweep past the timeout is ended with the Ray instance it started.
    return run_session(sweep_command(tmp, space, *extra), cwd=tmp, env=worker_env(), timeout=_TIMEOUT_S)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    pytest.importorskip("ray.tune", reason='the Ray backend needs pip install "lightning-par[tune]"')
    tmp = tmp_path_factory.mktemp("ray-sweep")
    return tmp, _sweep(tmp, SPACE, "--study-name", "ray-study")


@pytest.mark.slow
@pytest.mark.timeout(_TIMEOUT_S + 60)
def test_ray_runs_the_trials_stops_the_diverging_one_and_records_the_crash(sweep):
    tmp, done = sweep
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp / "out" / "results.json").read_text())
    assert results["study"] == "ray-study" and results["metric"] == "val_loss" and results["backend"] == "ray"
    trials = results["trials"]
    assert [t["number"] for t in trials] == [0, 1, 2, 3]
    assert [t["params"] for t in trials] == SPACE["enqueue"]
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL"]
    # Every validation was reported to Ray (steps 3 and 6); the stopped trial only its first.
    assert [t["steps"] for t in trials] == [[3, 6], [3, 6], [3], []]
    # (Each complete trial's value is the val_loss its own run logged: test_ray_trials_are_one_wandb_group.)
    assert trials[2]["value"] is None and trials[3]["value"] is None
    # The same per-trial files as the Optuna backend, and Ray's experiment beside them.
    out = tmp / "out"
    assert [len((out / f"trial-{n}.metrics.jsonl").read_text().splitlines()) for n in (0, 1)] == [3, 3]
    assert "n_head=3 does not divide n_embd=32" in (out / "trial-3.log").read_text()
    assert (out / "ray" / "ray-study").is_dir()
    best = min(trials[:2], key=lambda t: t["value"])
    assert f"best: trial {best['number']}, val_loss {best['value']:.4g}" in done.stdout
    assert "| 2 | pruned |" in done.stdout and "| 3 | fail |" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(_TIMEOUT_S + 60)
def test_ray_trials_are_one_wandb_group(sweep):
    tmp, done = sweep
    assert done.returncode == 0, done.stderr[-4000:]
    seen = []
    for run in sorted((tmp / "wandb").glob("offline-run-*")):
        reader = [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run)]
        read = subprocess.run(reader, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert read.returncode == 0, read.stderr[-2000:]
        records = [json.loads(line) for line in read.stdout.splitlines()]
        header = [r["run"] for r in records if r.get("type") == "run"]
        if not header:  # the stopped trial's W&B process was ended with it and may not have flushed its run
            continue
        history = [r["history"]["item"] for r in records if r.get("type") == "history"]
        val = [h["val_loss"] for h in history if "val_loss" in h]
        seen.append((header[0]["run_group"], header[0]["display_name"], val[-1] if val else None))
    # Both complete trials read back, each value Ray recorded being the last val_loss its run logged.
    trials = json.loads((tmp / "out" / "results.json").read_text())["trials"]
    logged = {name: value for _, name, value in seen}
    for i in (0, 1):
        assert logged[f"ray-study-{i}"] == pytest.approx(trials[i]["value"], rel=1e-6), (i, logged, trials[i])
    assert all(group == "ray-study" and name.startswith("ray-study-") for group, name, _ in seen)


def _space(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"parameters": {"model.init_args.lr": {"low": 1.0e-4, "high": 1.0}}, **raw}))
    return path


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"backend": "dask"}, "backend='dask'; use one of"),
        ({"backend": "ray", "algorithm": "pbt", "steps_per_generation": 2}, "pbt runs on backend: optuna only"),
        ({"resources": {"cpu": 2}}, "add 'backend: ray' or remove them"),
        ({"max_concurrent": 2}, "add 'backend: ray' or remove them"),
        ({"backend": "ray", "max_concurrent": 0}, "max_concurrent=0 must be an int >= 1"),
        ({"backend": "ray", "resources": {"cpus": 2}}, "give numbers per trial, e.g. {cpu: 2, gpu: 2}"),
        ({"backend": "ray", "resources": {"cpu": 0}}, "give numbers per trial"),
        ({"pruner": "hyperband"}, "pruner one of \\('median', 'asha', 'none'\\)"),
    ],
)
def test_bad_ray_spaces_are_refused_naming_the_fix(tmp_path, raw, message):
    with pytest.raises(SpaceError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_space(_space(tmp_path, raw))


def test_ray_backend_without_ray_names_the_extra(tmp_path, monkeypatch):
    # None in sys.modules makes `import ray` fail as it does where Ray is not installed.
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.tune", None)
    with pytest.raises(SpaceError, match=r'pip install "lightning-par\[tune\]"'):
        require_ray()
    space = load_space(_space(tmp_path, {"backend": "ray"}))
    with pytest.raises(SpaceError, match=r'pip install "lightning-par\[tune\]"'):  # before the recipe is read
        run_ray_sweep(tmp_path / "missing.yaml", space, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_flags_of_the_other_backend_are_refused(tmp_path, capsys):
    optuna_space, ray_space = _space(tmp_path, {}), tmp_path / "ray.yaml"
    ray_space.write_text(optuna_space.read_text() + "backend: ray\n")
    for space, flag, message in [(optuna_space, ["--ray-address", "auto"], "add 'backend: ray' to"),
                                 (ray_space, ["--storage", "sqlite:///x.db"], "drop --storage")]:  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            sweep_main(["--config", str(tmp_path / "recipe.yaml"), "--space", str(space), *flag])
    assert not (tmp_path / "sweeps").exists()


def test_trial_resources_follow_the_recipe_or_the_space(tmp_path):
    def recipe(trainer: dict) -> Path:
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({"trainer": trainer}))
        return path

    plain = load_space(_space(tmp_path, {"backend": "ray"}))
    assert trial_resources(recipe({"accelerator": "cpu", "devices": 2}), plain) == {"cpu": 2.0}
    assert trial_resources(recipe({"accelerator": "cpu"}), plain) == {"cpu": 1.0}
    assert trial_resources(recipe({"accelerator": "gpu", "devices": 4}), plain) == {"cpu": 4.0, "gpu": 4.0}
    assert trial_resources(recipe({"accelerator": "cuda", "devices": [0, 1]}), plain) == {"cpu": 2.0, "gpu": 2.0}
    with pytest.raises(SpaceError, match=r"set trainer.devices to a number, or 'resources"):
        trial_resources(recipe({"accelerator": "gpu", "devices": -1}), plain)
    given = load_space(_space(tmp_path, {"backend": "ray", "resources": {"cpu": 8, "gpu": 1}}))
    assert trial_resources(recipe({"accelerator": "gpu", "devices": -1}), given) == {"cpu": 8.0, "gpu": 1.0}
