"""Sharded checkpoints: resume on another layout, consolidate to one plain Lightning file, fail clearly when broken.

Resume test design (as `test_zero._resume_jobs`): one step per epoch over a fixed set of samples (the whole set is
one global batch), a checkpoint folder written by ModelCheckpoint at each epoch end, and a resume from the one after
step 2 on another layout (world size, ZeRO stage, or one process) for steps 3-4. Every step then sees the same
samples whatever the layout, so the resumed losses and parameters must equal those of the uninterrupted run on the
writing layout, up to float summation order. Tolerances as in test_zero.py: losses 1e-5 relative; parameters after
SGD 1e-5 relative / 1e-7 absolute; after AdamW an absolute 1% of the learning rate. The optimizer state found at
the start of the resumed run must equal the checkpoint's bit for bit (a reset Adam would pass a loose loss check).

The layouts are listed once, in `CHAINS` (how to add one: see there). Spawns (each costs seconds), by world size
and round: 2 ranks (writers, resumes on 2 ranks), 4 ranks (writers, resumes on 4), 1 process (writers, resumes on
1), 2 ranks again (resumes from 4 ranks and 1 process); then the consolidate CLI and a plain Lightning process that
cannot import lightning_par's strategies.
"""

from __future__ import annotations

import itertools
import pickle
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import ROOT, run_jobs, run_session, worker_env
from parity import rel

pytestmark = pytest.mark.slow  # multi-process: the slow tier (docs/testing.md, "Tiers")

LR = 3e-3  # the AdamW GPT's learning rate in _job_models.MODELS
GPT_KWARGS = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, "lr": LR}

# ---- the resharding matrix ------------------------------------------------------------------------------------
# Layouts a checkpoint is written on and resumed on, per model: (ranks, strategy), the strategy a registry name or
# ParallelStrategy kwargs. Neighbours in a chain resume each other's checkpoint, in both directions, so every
# layout is written on and resumed on, and the chains cross world sizes (2 <-> 4 <-> 2, 2 <-> 1 process) and ZeRO
# stages. To extend the matrix, add a layout to a chain once its strategy is supported; the writers, resumes,
# spawns and tests follow (`_dp` gives each job its data-parallel size, so every layout trains on the same global
# batch). The "gpt" chain crosses tensor, pipeline and context-parallel layouts: zero3 <-> tp_zero3 (tp 2 x dp 2) <->
# pipe_tp (pp 2 x tp 2) <-> tp_cp (tp 2 x cp 2) <-> tp (tp 2) <-> cp (cp 2) <-> plain data parallel. Expert layouts
# (moe ep=2 <-> ep=1, tp_moe, pipe_moe) are in tests/test_moe_parallel.py, test_tp_moe.py and test_pipe_moe.py;
# pipe_tp_zero3 in test_pipe_zero3.py.
# "gpt_uneven": dims 258 and 34 do not divide by 4, so shards differ in rows across ranks (as real vocabularies do).
ZERO0, ZERO1, ZERO3 = {"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 3}
CHAINS: dict[str, list[tuple[int, Any]]] = {
    # (2, "zero3") stays first-class here: the consolidation and bad-checkpoint tests below use its checkpoints.
    "gpt": [
        (2, "zero1"),
        (2, "zero3"),
        (4, "zero3"),
        (4, "tp_zero3"),
        (4, "pipe_tp"),
        (4, "tp_cp"),
        (2, "tp"),
        (2, "cp"),
        (2, ZERO0),
        (1, ZERO3),
    ],
    "gpt_sgd": [(2, "zero3"), (4, "zero2"), (2, "zero1"), (1, ZERO1)],
    "gpt_uneven": [(2, "zero2"), (4, "zero1"), (2, "zero3_offload")],
}
# Writers: (model, ranks, strategy). Each trains 4 one-step epochs and keeps every epoch's checkpoint.
WRITERS: list[tuple[str, int, Any]] = [(m, n, s) for m, chain in CHAINS.items() for n, s in chain]


def _name(ranks: int, strategy: Any) -> str:
    if isinstance(strategy, str):
        return f"{ranks}_{strategy}"
    return f"{ranks}_" + "_".join(f"{k.removesuffix('_stage')}{v}" for k, v in strategy.items())


# Resumes: name -> (model, writer's (ranks, strategy), reader's (ranks, strategy)).
RESUMES: dict[str, tuple[str, tuple[int, Any], tuple[int, Any]]] = {
    f"{m}_{_name(*a)}_to_{_name(*b)}": (m, a, b)
    for m, chain in CHAINS.items()
    for x, y in itertools.pairwise(chain)
    for a, b in ((x, y), (y, x))
}
BASE = {"epoch_steps": 1, "max_steps": 4}


def _dp(ranks: int, strategy: Any) -> int:
    """Data-parallel ranks of a layout (they split the global batch; tp and pp ranks share theirs)."""
    if isinstance(strategy, str):
        from lightning_par.config import split_world
        from lightning_par.strategies.registry import strategy_kwargs

        return split_world(strategy_kwargs(strategy)["auto_dims"], ranks, tp_cap=ranks)["dp"]
    return ranks // (strategy.get("tp", 1) * strategy.get("pp", 1))


def _key(model: str, ranks: int, strategy: Any) -> str:
    return f"{model}_{_name(ranks, strategy)}"


def _ckpt(root: Path, model: str, ranks: int, strategy: Any, epoch: int = 1) -> Path:
    return root / _key(model, ranks, strategy) / f"epoch={epoch}.ckpt"


def _params_close(got: dict, ref: dict, model: str, one_process: bool = False) -> None:
    rtol, atol = (1e-5, 1e-7) if model == "gpt_sgd" else (1e-5, 0.01 * LR)
    if model == "gpt_sgd" and one_process:
        # Steps 3-4 in one process vs two ranks: the global batch's loss is summed in another order (one mean of 8
        # samples vs the mean of two ranks' means of 4), and SGD with lr 0.5 + momentum carries that rounding into
        # the weights. Measured: one lm_head element of 8192 off by 2.7e-7 (3e-5 of its value of 8e-3).
        atol = 1e-6
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ckpt")
    root = tmp / "ckpts"
    out: dict[str, Any] = {"root": root}

    hub = _key("gpt", 2, "zero3")

    def truncated() -> dict[str, Any]:
        # A resume from a truncated copy must fail on every rank before the first step, and not hang.
        bad = tmp / "truncated.ckpt"
        shutil.copytree(_ckpt(root, "gpt", 2, "zero3"), bad)
        data = (bad / "__1_0.distcp").read_bytes()
        (bad / "__1_0.distcp").write_bytes(data[: len(data) // 2])
        return {**BASE, "model": "gpt", "strategy": "zero3", "resume": str(bad), "expect_error": True}

    def foreign() -> dict[str, Any]:
        # A different model (Llama) resumed from the GPT checkpoint, in one process under ParallelStrategy.
        resume = str(_ckpt(root, "gpt", 2, "zero3"))
        return {**BASE, "model": "llama", "strategy": ZERO3, "expect_error": True, "resume": resume}

    # name -> (ranks, writer it reads, job); a job is built once its writer's checkpoints exist.
    pending: dict[str, tuple[int, str, Any]] = {
        _key(m, n, s): (
            n,
            "",
            {**BASE, "model": m, "strategy": s, "dp": _dp(n, s), "ckpt_dir": str(root / _key(m, n, s))},
        )
        for m, n, s in WRITERS
    }
    for name, (m, src, dst) in RESUMES.items():
        job = {**BASE, "model": m, "strategy": dst[1], "dp": _dp(*dst), "resume": str(_ckpt(root, m, *src)),
               "record_optim": True}  # fmt: skip
        pending[name] = (dst[0], _key(m, *src), job)
    pending["truncated_2_ranks"] = (2, hub, truncated)
    pending["foreign_1_rank"] = (1, hub, foreign)
    # Spawns (each costs seconds) by world size, round after round: a spawn runs its writers first, then every job
    # whose writer has run (in an earlier spawn, or in this one for a plain resume).
    spawn = 0
    while pending:
        before = len(pending)
        for ranks in sorted({n for n, _, _ in pending.values()}, key=lambda n: (n == 1, n)):
            here = [k for k, (n, src, _) in pending.items() if n == ranks and not src]
            ready = set(out) | set(here)
            here += [
                k for k, (n, src, job) in pending.items()
                if n == ranks and src and (src in out or (src in ready and isinstance(job, dict)))
            ]  # fmt: skip
            if not here:
                continue
            jobs = [job if isinstance(job, dict) else job() for _, _, job in (pending.pop(k) for k in here)]
            spawn += 1
            out.update(zip(here, run_jobs(tmp / f"s{spawn}", jobs, nproc=ranks, timeout=300), strict=True))
        assert len(pending) < before, f"jobs whose writer never runs: {sorted(pending)}"
    return out


# ---- 1. resume on another layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_on_another_layout_continues_the_run(runs, case):
    from lightning_par.checkpoint import load_full_state

    model, src, dst = RESUMES[case]
    full, resumed = runs[_key(model, *src)], runs[case]
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    assert resumed["layout"]["world_size"] == dst[0]
    assert rel(resumed["losses"], full["losses"][2:]) < 1e-5
    _params_close(resumed["params"], full["params"], model, one_process=1 in (src[0], dst[0]))
    # The optimizer state the resumed run starts from is the checkpoint's, resharded: moments and step counts.
    saved = load_full_state(_ckpt(runs["root"], model, *src))["optimizer_0"]["state"]
    got = resumed["optim_at_start"]
    assert got.keys() == saved.keys() == full["params"].keys()
    for name, state in saved.items():
        assert got[name].keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(got[name][k], v.float()), (name, k)
    moments = [v for st in saved.values() for k, v in st.items() if k in ("exp_avg", "momentum_buffer")]
    assert all(v.abs().sum() > 0 for v in moments[:3])  # a real state, not zeros
    if model != "gpt_sgd":  # AdamW
        assert all(float(st["step"]) == 2 for st in saved.values())


def test_checkpoint_folders_have_one_data_file_per_writing_rank(runs):
    for model, ranks, strategy in WRITERS:
        files = sorted(p.name for p in _ckpt(runs["root"], model, ranks, strategy).glob("*.distcp"))
        assert files == [f"__{r}_0.distcp" for r in range(ranks)]


# ---- 2. consolidation to one plain Lightning file ----------------------------------------------------------------
# Runs without lightning_par's package __init__ (which imports and registers the strategies): a stub package with
# the same path lets `lightning_par.models` / `.data` (plain Lightning code) import, and nothing else.
PLAIN = r"""
import sys, types
import torch
torch.set_num_threads(1)
root, weights_file, resume_file, out = sys.argv[1:5]
stub = types.ModuleType("lightning_par")
stub.__path__ = [root + "/lightning_par"]
sys.modules["lightning_par"] = stub
import lightning as L
from lightning_par.data import ByteTextDataModule
from lightning_par.models import GPT

weights = {k: v.clone() for k, v in GPT.load_from_checkpoint(weights_file, map_location="cpu").state_dict().items()}

class Record(L.Callback):
    losses, optim = [], {}
    def on_train_start(self, trainer, pl_module):
        names = {p: n for n, p in pl_module.named_parameters()}
        opt = trainer.optimizers[0]
        Record.optim = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        Record.losses.append(float(outputs["loss"]))

model = GPT.load_from_checkpoint(resume_file, map_location="cpu")
data = ByteTextDataModule(seq_len=32, batch_size=8, num_samples=8, seed=0)
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0, callbacks=[Record()])
trainer.fit(model, datamodule=data, ckpt_path=resume_file)
# models may import lightning_par.nn (building blocks such as MoE), which imports nothing else from the package
allowed = ("models", "data", "nn")
leaked = sorted(m for m in sys.modules if m.startswith("lightning_par.") and m.split(".")[1] not in allowed)
params = {n: p.detach().clone() for n, p in model.named_parameters()}
torch.save({"weights": weights, "losses": Record.losses, "optim": Record.optim, "params": params, "leaked": leaked,
            "strategy": type(trainer.strategy).__name__}, out)
"""


@pytest.fixture(scope="module")
def plain(runs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Consolidate the 2-rank ZeRO-3 checkpoints (epoch 1 with the CLI, the last in-process) and use them plainly."""
    from lightning_par.checkpoint import consolidate

    tmp = tmp_path_factory.mktemp("plain")
    resume_file, weights_file = tmp / "epoch1.ckpt", tmp / "epoch3.ckpt"
    cli = [sys.executable, "-m", "lightning_par.cli", "consolidate", str(_ckpt(runs["root"], "gpt", 2, "zero3"))]
    proc = run_session([*cli, str(resume_file)], env=worker_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"wrote {resume_file}" in proc.stdout
    written = consolidate(_ckpt(runs["root"], "gpt", 2, "zero3", epoch=3), weights_file)
    script = tmp / "plain.py"
    script.write_text(PLAIN)
    result = tmp / "plain.pt"
    args = [sys.executable, str(script), str(ROOT), str(weights_file), str(resume_file), str(result)]
    proc = run_session(args, env=worker_env(), timeout=180, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"written": written, "resume_file": resume_file, **torch.load(result)}


def test_consolidated_file_loads_in_plain_lightning_without_the_strategies(runs, plain):
    full = runs[_key("gpt", 2, "zero3")]
    assert plain["leaked"] == [] and plain["strategy"] == "SingleDeviceStrategy"
    # GPT.load_from_checkpoint of the last epoch's file: exactly the run's gathered parameters.
    assert plain["weights"].keys() == full["params"].keys()
    for name, value in full["params"].items():
        assert torch.equal(plain["weights"][name], value), name


def test_plain_lightning_resumes_from_the_consolidated_file_with_its_optimizer_state(runs, plain):
    from lightning_par.checkpoint import load_full_state

    full = runs[_key("gpt", 2, "zero3")]
    saved = load_full_state(_ckpt(runs["root"], "gpt", 2, "zero3"))["optimizer_0"]["state"]
    assert plain["optim"].keys() == saved.keys()
    for name, state in saved.items():
        for k, v in state.items():
            assert torch.equal(plain["optim"][name][k], v), (name, k)
    assert rel(plain["losses"], full["losses"][2:]) < 1e-5
    _params_close({n: p.float() for n, p in plain["params"].items()}, full["params"], "gpt")


def test_consolidated_file_is_a_regular_lightning_checkpoint(plain):
    ckpt = torch.load(plain["resume_file"], weights_only=True)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters", "epoch"):
        assert key in ckpt, key
    assert ckpt["pytorch-lightning_version"] and ckpt["global_step"] == 2
    (opt,) = ckpt["optimizer_states"]
    ids = [i for group in opt["param_groups"] for i in group["params"]]
    assert ids == list(range(len(ckpt["state_dict"]))) and sorted(opt["state"]) == ids
    assert not any(k.startswith("optimizer_") and k != "optimizer_states" for k in ckpt)


def test_safetensors_weights(plain):
    out = plain["written"][0]
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert plain["written"] == [out]  # skipped quietly, as documented
        pytest.skip("the safetensors package is not installed (it is no dependency of lightning_par)")
    assert plain["written"] == [out, out.with_name(out.name + ".safetensors")]
    weights = load_file(str(plain["written"][1]))
    ref = torch.load(out, weights_only=True)["state_dict"]
    assert weights.keys() == ref.keys() and all(torch.equal(weights[k], ref[k]) for k in ref)


# ---- 3. bad checkpoints fail clearly, before training ------------------------------------------------------------
def test_bad_checkpoints_fail_before_the_first_step_on_every_rank(runs):
    truncated = runs["truncated_2_ranks"]
    assert truncated["losses"] == [] and "CheckpointError" in truncated["error"]
    assert "__1_0.distcp is truncated" in truncated["error"]
    foreign = runs["foreign_1_rank"]
    assert foreign["losses"] == [] and "does not match the model" in foreign["error"]
    assert "missing from the checkpoint" in foreign["error"] and "unexpected key(s)" in foreign["error"]


@pytest.fixture
def good(runs, tmp_path: Path) -> Path:
    copy = tmp_path / "epoch=1.ckpt"
    shutil.copytree(_ckpt(runs["root"], "gpt", 2, "zero3"), copy)
    return copy


def _load(path: Path, strict: bool = True, **model: Any) -> torch.nn.Module:
    from lightning_par.checkpoint import load_sharded
    from lightning_par.models import GPT

    module = GPT(**{**GPT_KWARGS, **model})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load in a single process")  # DCP with no process group
        load_sharded(path, module, [], strict=strict)
    return module


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: _truncate(p / "__0_0.distcp"), "__0_0.distcp is truncated: "),
        (lambda p: (p / "__1_0.distcp").unlink(), "__1_0.distcp is missing: the index .metadata lists 2 data files"),
        (lambda p: (p / "meta.pt").unlink(), "meta.pt is missing"),
        (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
        (lambda p: _truncate(p / ".metadata"), ".metadata is corrupt or truncated"),
        (lambda p: _truncate(p / "meta.pt"), "meta.pt is corrupt or truncated"),
    ],
    ids=["truncated_shard", "missing_shard", "missing_meta", "missing_index", "truncated_index", "truncated_meta"],
)
def test_damaged_folder_names_the_file(good, damage, message):
    from lightning_par.checkpoint import CheckpointError

    damage(good)
    with pytest.raises(CheckpointError, match="copy the whole folder again") as err:
        _load(good)
    assert message in str(err.value) and str(good) in str(err.value)


def test_other_model_lists_keys_and_shapes(good):
    from lightning_par.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"shape mismatch\(es\): state_dict.transformer.wte.weight: checkpoint "
                       r"\(256, 32\) vs model \(256, 48\)"):  # fmt: skip
        _load(good, n_embd=48)
    with pytest.raises(
        CheckpointError, match=r"12 model key\(s\) missing from the checkpoint: state_dict.transformer.h.2"
    ):
        _load(good, n_layer=3)
    with pytest.raises(CheckpointError, match=r"12 unexpected key\(s\) in the checkpoint: state_dict.transformer.h.1"):
        _load(good, n_layer=1)
    # strict_loading=False: the missing block keeps its initialisation, the rest is loaded.
    with pytest.warns(UserWarning, match=r"strict_loading=False: 12 model key\(s\) not in checkpoint"):
        module = _load(good, strict=False, n_layer=3)
    ref = _load(good)
    assert torch.equal(module.transformer.h[1].mlp.c_fc.weight, ref.transformer.h[1].mlp.c_fc.weight)


def test_plain_file_or_parent_folder_is_refused(good, tmp_path):
    from lightning_par.checkpoint import CheckpointError, consolidate

    file = tmp_path / "single.ckpt"
    consolidate(good, file)
    with pytest.raises(CheckpointError, match=r"single.ckpt is a file, not a folder"):
        _load(file)
    with pytest.raises(CheckpointError, match=r"is a folder of checkpoints \(epoch=1.ckpt\), not a checkpoint"):
        _load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nothing")


class _Touch:
    """Unpickles to a call that creates a file: stands for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_index_that_names_code_is_refused(good, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_par.checkpoint import CheckpointError

    marker = tmp_path / "ran"
    index = FileSystemReader(str(good)).read_metadata()
    index.storage_meta.modules = [_Touch(marker)]
    (good / ".metadata").write_bytes(pickle.dumps(index))
    FileSystemReader(str(good)).read_metadata()  # DCP's own reader unpickles it: the code runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match="names code to run"):
        _load(good)
    assert not marker.exists()


def test_non_tensor_value_that_names_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lightning_par.checkpoint import CheckpointError, load_full_state

    marker, folder = tmp_path / "ran", tmp_path / "crafted.ckpt"
    groups = [{"params": ["w"], "lr": 0.1, "evil": _Touch(marker)}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {"w": torch.zeros(2)}, "optimizer_0": {"state": {}, "param_groups": groups}},
                 checkpoint_id=folder, no_dist=True)  # fmt: skip
    torch.save({"epoch": 0}, folder / "meta.pt")
    with pytest.raises(CheckpointError, match="refuses: corrupt bytes, or an object that would run code"):
        load_full_state(folder)
    assert not marker.exists()


def test_cli_reports_a_bad_folder_without_a_traceback(tmp_path, monkeypatch, capsys):
    from lightning_par.cli import main

    monkeypatch.setattr(sys, "argv", ["lightning-par", "consolidate", str(tmp_path / "none"), str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "lightning-par consolidate: error: checkpoint" in err and "does not exist" in err
