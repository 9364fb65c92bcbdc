"""A trunk whose blocks run more than once in one forward, under pipeline parallelism: the stages cut the calls.

ALBERT calls its one layer at every depth (``[0, 0, 0, 0]``); a recurrent-depth model runs a core block again and
again (Dory ``[0, 1, 2, 1, 2, 3]``, tests/_looped_models.py ``[0, 1, 1, 1, 2]``, its core re-injecting the
embedding's output). The ownership probe sees the call order and makes the trunk one of calls; every stage holds the
blocks that run more than once, starting from the first stage's values, and their gradients (each stage's share,
from the calls it ran) are summed over the pipeline group after each step (`pipeline.tied.OnEveryStage`).

Quick tests chain the stages by hand in one process; slow ones train against one process (fp32, SGD + momentum:
losses and gradient norms 1e-5 relative, parameters 1e-5 relative / 1e-7 absolute, as tests/test_pipeline.py).
Two spawns (2 and 4 ranks) and one reference process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _chained import chain_stages, summed_grads
from _looped_models import LoopedLM
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel
from torch import nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.parallel.pipeline.owners import find_ownership
from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel


def _albert() -> Any:
    from _families import HFAlbert

    torch.manual_seed(0)
    return HFAlbert()


def _looped() -> Any:
    torch.manual_seed(0)
    return LoopedLM()


def test_a_block_that_runs_more_than_once_makes_a_trunk_of_calls() -> None:
    albert = _albert()
    layer = "model.albert.encoder.albert_layer_groups.0.albert_layers.0"
    own = find_ownership(albert, find_trunk(albert))
    assert own.calls is not None and own.calls.names == (layer,) * 4  # one place per call, one module
    assert own.calls.repeated == {layer: albert.get_submodule(layer)}
    held = {f"{layer}.{n}" for n, _ in albert.get_submodule(layer).named_parameters()}
    assert held <= set(own.everywhere)  # on every stage, gradients summed over the pipeline
    looped = _looped()
    own = find_ownership(looped, find_trunk(looped))
    assert own.calls is not None and own.calls.names == ("blocks.0", *["blocks.1"] * 3, "blocks.2")
    assert list(own.calls.repeated) == ["blocks.1"]  # the prelude and the coda run once: one stage each
    assert set(own.everywhere) == {f"blocks.1.{n}" for n, _ in looped.blocks[1].named_parameters()}
    # The core's re-injected input (the embedding's output) travels down the pipeline like an encoder's output.
    assert [(s.kind, s.path) for s in own.sides] == [("before", "emb")]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))


@pytest.mark.parametrize(("name", "ranges"), [
    ("albert", [(0, 1), (1, 3), (3, 4)]),
    ("looped", [(0, 2), (2, 4), (4, 5)]),  # the core's three calls on all three stages
])  # fmt: skip
def test_stages_of_calls_chained_by_hand_give_the_full_model_loss_and_gradients(name: str, ranges: list) -> None:
    full = _albert() if name == "albert" else _looped()
    x, y = _batch()

    def loss(m: Any) -> torch.Tensor:  # the user's own loss (HFAlbert's takes the batch)
        return m._loss((x, y)) if name == "albert" else m._loss(x, y)

    ref = loss(full)
    ref.backward()
    outs, cuts, pipes = chain_stages(full, ranges, loss)  # each stage on its own "rank"
    out = outs[-1]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    out.backward()  # the stages' graphs are chained in one process
    shared = set(pipes[0].ownership.everywhere)
    # A stage module's parameters: its own blocks and units, and every block that runs more than once (the middle
    # stage runs calls of the shared block alone).
    assert set(dict(pipes[1].stage_modules()[0].named_parameters())) == {f"everywhere.{k}" for k in range(len(shared))}
    # A block held by every stage, a tied weight on both ends (ALBERT's head is its embedding): the stages' shares sum.
    got = summed_grads(cuts, pipes[0].ownership.tied)
    for n, p in full.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda msg, n=n: f"{n}: {msg}")


@pytest.mark.parametrize("train_loops", [2, 4])
def test_a_forward_that_runs_its_blocks_otherwise_than_the_probe_saw_is_refused_naming_the_call(
    train_loops: int,
) -> None:
    # The probe runs in eval mode; this model runs its core another number of times in training mode.
    model = LoopedLM(train_loops=train_loops)
    batch = _batch()
    pipe = PipelineModel(model, find_trunk(model), [(0, 2), (2, 5)], [1], torch.device("cpu"))
    pipe.install()
    pipe.begin_step(lambda _mb, _spec: model._loss(*batch))
    with pytest.raises(PipelineError, match="a trunk whose blocks run more than once must run them in the same order"):
        pipe.run_stage(pipe.specs[0], torch.zeros(2, 16, 32), 0, (torch.zeros(2, 16, 32),))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.seen = self.gate(h)  # read after the trunk, as a recorder of router logits would
        return torch.tanh(self.fc(h))


class _RecordsInALoop(nn.Module):
    """The calls ``[0, 1, 1]``; code after the trunk reads what a module inside block 1 returned."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(_Gated() for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.emb(x))
        for _ in range(2):
            h = self.blocks[1](h)
        return self.head(h) + self.blocks[1].seen


def test_values_read_after_a_trunk_of_calls_from_inside_its_blocks_are_refused() -> None:
    # Such values are replayed by block on the stages that do not run it, one producer per block: not for a block
    # that runs more than once. Refused at the cut, naming the producer and a layout that trains it.
    model = _RecordsInALoop()
    refused = r"blocks\.1\.gate makes a value that code after the trunk reads, in a trunk whose blocks run more "
    with pytest.raises(PipelineError, match=refused + r"than once \(blocks\).*strategy=.zero3."):
        PipelineModel(model, find_trunk(model), [(0, 1), (1, 3)], [0], torch.device("cpu"))


def test_the_planner_holds_a_block_that_runs_more_than_once_on_every_stage() -> None:
    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import stage_ranges

    specs = specs_from_module(_albert())
    layer = [s for s in specs if ".albert_layers.0." in s.name]
    assert layer and all(s.calls == (0, 1, 2, 3) for s in layer)
    assert stage_ranges(specs, Layout(pp=4, precision="32-true")) == [(0, 1), (1, 2), (2, 3), (3, 4)]


# ---- against one process --------------------------------------------------------------------------------------

JOBS_2 = {
    "albert_1f1b": {"model": "hf_albert", "strategy": {"pp": 2}},
    # 4 calls, 4 stages: rank 0 runs calls 0 and 2, and its two stage modules share the layer.
    "albert_interleaved": {"model": "hf_albert", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"}},
    "dory": {"model": "zoo:dory", "strategy": {"pp": 2}},
    # The V schedule's weight passes compute the shared core's gradients; each held block recomputed once.
    "looped_zbv_ac": {"model": "looped_lm", "strategy": {"pp": 2, "pp_schedule": "zbv",
                                                         "activation_checkpointing": "full"}},
}  # fmt: skip
JOBS_4 = {
    "albert_pipe_tp": {"model": "hf_albert", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    "albert_pp4": {"model": "hf_albert", "strategy": {"pp": 4}, "dp": 1},
    "looped_zero1": {"model": "looped_lm", "strategy": {"pp": 2, "zero_stage": 1}, "dp": 2},
}
ALL = {**JOBS_2, **JOBS_4}


def _resume_jobs(tmp: Path) -> list[dict[str, Any]]:
    ckpt = str(tmp / "looped")
    base = {"model": "looped_lm", "epoch_steps": 1, "max_steps": 4}
    return [
        {**base, "strategy": "pipe", "dp": 1, "ckpt_dir": ckpt},
        {**base, "strategy": "pipe", "dp": 1, "resume": f"{ckpt}/epoch=1.ckpt"},
        {**base, "strategy": "zero1", "dp": 2, "resume": f"{ckpt}/epoch=1.ckpt"},
        {"model": "looped_lm", "strategy": {"pp": 2, "zero_stage": 3}, "dp": 1, "steps": 1, "expect_error": True},
    ]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, tuple[dict, dict]], list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("pipeline_calls")
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k not in ("strategy", "dp")})
                          for j in ALL.values()], nproc=1, timeout=900)  # fmt: skip
    got = run_jobs(tmp, [{**j, "dp": 1} for j in JOBS_2.values()] + _resume_jobs(tmp), nproc=2, timeout=900)
    got, resumed = got[: len(JOBS_2)], got[len(JOBS_2) :]
    got += run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=900)
    return dict(zip(ALL, zip(got, refs, strict=True), strict=True)), resumed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(ALL))
def test_matches_one_process(spawns, name):
    got, ref = spawns[0][name]
    assert got.get("error") is None, got["error"]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5  # a block held by every stage counted once
    params = dict(got["params"])
    for names in got.get("tied", []):  # ALBERT's head is tied to its embedding: one copy per end stage
        for alias in names[1:]:
            assert torch.equal(params.pop(alias, params[names[0]]), params[names[0]])
    params_close(params, ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_rank_holds_the_bytes_the_planner_predicts(spawns):
    from _job_models import MODELS

    from lightning_par.planner.layout import Layout
    from lightning_par.planner.params import specs_from_module
    from lightning_par.planner.state import state_bytes

    got, _ = spawns[0]["albert_pp4"]
    specs = specs_from_module(MODELS["hf_albert"]())
    want = [state_bytes(specs, Layout(pp=4, precision="32-true"), rank=r).parameters for r in range(4)]
    assert [m["params"] for m in got["mem_all"]] == want
    layer = sum(s.numel * 4 for s in specs if s.calls)
    assert want[1] == want[2] == layer > 0  # the shared layer on every rank; the middle ranks hold it alone


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_resumes_across_layouts_and_zero3_is_refused(spawns):
    # The shared core is written once (DCP keeps one copy of a tensor several ranks save under one name) and read
    # back on every stage; a pipeline checkpoint resumes under pipe and under zero1.
    full, as_pipe, as_zero1, zero3 = spawns[1]
    for resumed in (as_pipe, as_zero1):
        assert len(resumed["losses"]) == 2 and rel(resumed["losses"], full["losses"][2:]) < 1e-5
        params_close(resumed["params"], full["params"], rtol=1e-5, atol=1e-7)
    assert zero3["losses"] == [] and "blocks.1 runs more than once in one forward" in zero3["error"]
    assert "strategy='pipe_zero1'" in zero3["error"]
