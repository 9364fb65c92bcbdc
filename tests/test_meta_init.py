"""Models built on the meta device, and pretrained weights read into any layout (docs/large_models.md).

Every model here is built in ``configure_model()`` or under ``trainer.init_module(empty_init=True)``, so no rank
ever holds it whole: each rank allocates and initialises only its share (`lightning_par.parallel.materialize`).
The reference is the same meta-built model in one process (the same strategy class at world size 1). Checked:

- the weights right after set-up are bitwise equal to the reference's, on every layout (init is layout
  independent: each unit is seeded from the job's seed and its own name);
- the loss curve and the trained parameters follow the reference: fp32 losses and gradient norms within 1e-5
  relative, SGD + momentum parameters within 1e-5 relative / 1e-7 absolute;
- ``pretrained=`` reads a Hugging Face folder into zero3, tp x pp and expert-parallel layouts: the weights after
  set-up equal the file bitwise, and training follows the same weights loaded by ``from_pretrained`` in one
  process; a file of another model is refused before the first step, naming the file.

Unit tests of the initialisation contract (which rules run, refusals) run in this process, without spawns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import params_close, rel, without_tied_copies
from safetensors.torch import load_file
from torch import nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.parallel.materialize import UninitializedError, capture_init, init_unit

pytestmark = pytest.mark.timeout(900)

META = {"empty_init": True, "record_init": True, "steps": 3}
# name -> (model, strategy kwargs, ranks, extra job keys); dp 1 where every rank of a tp/pp group reads one batch.
JOBS: dict[str, tuple[str, dict[str, Any], int, dict[str, Any]]] = {
    "llama_zero3": ("hf_llama_deferred", {"zero_stage": 3}, 2, {}),
    "llama_tp_zero3": ("hf_llama_deferred", {"tp": 2, "zero_stage": 3}, 4, {"dp": 2}),
    "llama_pipe_tp": ("hf_llama_deferred", {"pp": 2, "tp": 2}, 4, {"dp": 1}),
    "llama_pipe_zero3": ("hf_llama_deferred", {"pp": 2, "zero_stage": 3}, 4, {"dp": 2}),
    "gpt2_tp_zero2": ("hf_gpt2", {"tp": 2, "zero_stage": 2}, 4, {"dp": 2}),
    "mixtral_zero3": ("hf_mixtral_deferred", {"zero_stage": 3}, 2, {}),
    "mixtral_moe_zero3": ("hf_mixtral_deferred", {"ep": 2, "zero_stage": 3}, 2, {}),
    "gpt2_tied_pipe": ("hf_gpt2", {"pp": 2}, 2, {"dp": 1}),
    "litgpt_llama_tp": ("litgpt_llama", {"tp": 2}, 2, {"dp": 1}),
    "vit_zero1": ("hf_vit", {"zero_stage": 1}, 2, {}),
    "bert_pipe": ("hf_bert", {"pp": 2}, 2, {"dp": 1}),
    "user_moe_list_ep": ("user_moe_list", {"ep": 2}, 2, {}),
}
EXPERT_SHARDED = {"mixtral_moe_zero3", "user_moe_list_ep"}  # init_state holds this rank's experts only


def _job(model: str, strategy: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "strategy": strategy, **META, **extra}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    tmp = tmp_path_factory.mktemp("meta")
    models = sorted({m for m, *_ in JOBS.values()})
    refs = dict(zip(models, run_jobs(tmp, [_job(m, {}, {}) for m in models], nproc=1, timeout=900), strict=True))
    out: dict[str, tuple[dict, dict]] = {}
    for n in (2, 4):
        names = [k for k, (_, _, ranks, _) in JOBS.items() if ranks == n]
        got = run_jobs(tmp, [_job(JOBS[k][0], JOBS[k][1], JOBS[k][3]) for k in names], nproc=n, timeout=900)
        out.update({k: (g, refs[JOBS[k][0]]) for k, g in zip(names, got, strict=True)})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_meta_built_model_matches_one_process(results: dict[str, tuple[dict, dict]], name: str) -> None:
    got, ref = results[name]
    if name not in EXPERT_SHARDED:
        init, ref_init = got["init_state"], ref["init_state"]
        assert init.keys() == ref_init.keys()
        differ = [k for k in init if not torch.equal(init[k], ref_init[k])]
        assert not differ, f"weights after set-up differ from one process in {differ[:5]}"
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params = without_tied_copies(got, ref)
    params_close(params, ref["params"], rtol=1e-5, atol=1e-7)


# ---- pretrained weights -------------------------------------------------------------------------------------
PRETRAINED = {
    "llama_zero3": ("hf_llama_deferred", {"zero_stage": 3}, 2, {}),
    "mixtral_moe": ("hf_mixtral_deferred", {"ep": 2}, 2, {}),
    "llama_pipe_tp": ("hf_llama_deferred", {"pp": 2, "tp": 2}, 4, {"dp": 1}),
}


def _save_folders(tmp: Path) -> dict[str, Path]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _hf_models import HFLlama
    from _job_models import HFMixtralLM

    folders = {}
    for name, build in (("hf_llama_deferred", lambda: HFLlama().model), ("hf_mixtral_deferred", HFMixtralLM.build)):
        torch.manual_seed(7)  # other weights than any seed-0 initialisation
        folders[name] = tmp / name
        build().save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pretrained")
    folders = _save_folders(tmp)
    ref_jobs = [
        {"model": m, "strategy": "auto", "hf_from_pretrained": str(f), "steps": 3, "record_init": True}
        for m, f in folders.items()
    ]
    refs = dict(zip(folders, run_jobs(tmp, ref_jobs, nproc=1, timeout=600), strict=True))
    out: dict[str, Any] = {"folders": folders}
    for n in (2, 4):
        names = [k for k, (_, _, ranks, _) in PRETRAINED.items() if ranks == n]
        jobs = [
            {"model": m, "strategy": {**s, "pretrained": str(folders[m])}, **META, **e}
            for m, s, _, e in (PRETRAINED[k] for k in names)
        ]
        if n == 2:  # Mixtral's weights into the Llama: refused before the first step, naming the file
            wrong = {"zero_stage": 3, "pretrained": str(folders["hf_mixtral_deferred"])}
            jobs.append({"model": "hf_llama_deferred", "strategy": wrong, "empty_init": True, "expect_error": True})
        got = run_jobs(tmp, jobs, nproc=n, timeout=900)
        out.update({k: (g, refs[PRETRAINED[k][0]]) for k, g in zip(names, got[: len(names)], strict=True)})
        if n == 2:
            out["wrong"] = got[-1]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRETRAINED))
def test_pretrained_weights_into_any_layout(pretrained: dict[str, Any], name: str) -> None:
    got, ref = pretrained[name]
    model = PRETRAINED[name][0]
    file = load_file(str(pretrained["folders"][model] / "model.safetensors"))
    if name != "mixtral_moe":  # expert shards are this rank's only
        init = got["init_state"]
        for key, value in file.items():
            assert torch.equal(init[f"model.{key}"], value), key
        assert torch.equal(init["model.lm_head.weight"], file["lm_head.weight"])
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(dict(got["params"]), ref["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_pretrained_of_another_model_is_refused_before_training(pretrained: dict[str, Any]) -> None:
    got = pretrained["wrong"]
    assert got["error"] is not None and got["losses"] == []
    assert "hf_mixtral_deferred" in got["error"], got["error"]  # the file named


# ---- the initialisation contract, in this process -------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Scaled(nn.Module):
    """A user module with its own parameter and no way to initialise it off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.scale = nn.Parameter(torch.ones(4))


class _WithReset(_Scaled):
    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)


class _Buffered(nn.Module):
    """A non-persistent table computed in __init__, left on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Module()
        self.head.register_buffer("table", torch.arange(4.0), persistent=False)


def _units(cls: type[nn.Module]) -> Any:
    with torch.device("meta"):
        model = cls()
    return capture_init(model, find_trunk(model))


def test_a_parameter_nothing_initialises_is_refused_with_its_name() -> None:
    units = _units(_Scaled).units
    with pytest.raises(UninitializedError, match=r"^scale \(_Scaled\).*Define reset_parameters\(\) on _Scaled"):
        init_unit(units[""], torch.device("cpu"), 0)
    with pytest.raises(UninitializedError, match=r"^head.table \(Module\)"):
        init_unit(_units(_Buffered).units["head"], torch.device("cpu"), 0)


def test_reset_parameters_and_torch_layers_initialise_each_unit_the_same_way() -> None:
    templates = _units(_WithReset)
    assert list(templates.units) == ["", "blocks.0", "blocks.1"]
    assert torch.equal(init_unit(templates.units[""], torch.device("cpu"), 0)["scale"], torch.ones(4))
    a = init_unit(templates.units["blocks.0"], torch.device("cpu"), 0)
    again = init_unit(templates.units["blocks.0"], torch.device("cpu"), 0)
    b = init_unit(templates.units["blocks.1"], torch.device("cpu"), 0)
    other_seed = init_unit(templates.units["blocks.0"], torch.device("cpu"), 1)
    assert torch.equal(a["proj.weight"], again["proj.weight"])  # the unit's name and the seed decide, nothing else
    assert not torch.equal(a["proj.weight"], b["proj.weight"])
    assert not torch.equal(a["proj.weight"], other_seed["proj.weight"])
    assert a["proj.weight"].abs().max() <= 0.5  # torch's own Linear init: U(-1/sqrt(4), 1/sqrt(4))
