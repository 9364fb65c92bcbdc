"""Hugging Face files in another layout than the modules (transformers 5 saves MoE experts one by one, holds them
stacked) read through transformers' own conversion mapping (checkpoint/pretrained/convert.py), and the export back.
Tiny models from configs saved with ``save_pretrained`` (no downloads); the reference is ``from_pretrained`` of the
same folder. One 2-rank spawn checks expert-sharded and FSDP2 views bitwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from torch import nn

from lightning_par.checkpoint.pretrained.load import PretrainedError, load_pretrained
from lightning_par.utils import clean_exit

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _family(name: str) -> nn.Module:
    """The LightningModule of ``name`` (the Hugging Face model under ``self.model``), every tensor made distinct."""
    import _families_moe
    from _job_models import HFMixtralLM

    build = {"mixtral": HFMixtralLM, "qwen2_moe": _families_moe.HFQwen2MoE, "deepseek_v3": _families_moe.HFDeepseekV3,
             "olmoe": _families_moe.HFOlmoe}[name]  # fmt: skip
    module = build()
    with torch.no_grad():  # norms start at ones, biases at zeros: a fresh model must differ from the file everywhere
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    return module


def _saved(name: str, root: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    folder = root / name
    _family(name).model.save_pretrained(folder)
    return folder


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved("mixtral", tmp_path_factory.mktemp("convert"))


# ---- one process -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "olmoe"])
def test_moe_families_read_bitwise_as_from_pretrained(name, tmp_path):
    folder = _saved(name, tmp_path)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # the file really is in the per-expert layout
    want = _reference(folder)
    torch.manual_seed(1)
    module = _family(name)
    report = load_pretrained(folder, module.state_dict(), module_type=type(module).__name__, hf_model=module)
    got = module.state_dict()
    assert [k for k, v in want.items() if not torch.equal(got[f"model.{k}"], v)] == []
    assert "converted from" in report.format and "mapping" in report.format, report.format
    assert any("experts.gate_up_proj" in k for k in want)


def test_without_the_model_or_for_another_model_the_file_is_refused(mixtral, tmp_path):
    module = _family("mixtral")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PretrainedError, match=r"missing from the file: .*mlp.experts.down_proj.*the module lacks"):
        load_pretrained(mixtral, module.state_dict())  # no hf_model: names as they are
    other = _family("qwen2_moe")  # its mapping does not touch Mixtral's block_sparse_moe keys
    with pytest.raises(PretrainedError, match=r"does not fit .*block_sparse_moe.experts.0.w1.weight"):
        load_pretrained(mixtral, other.state_dict(), hf_model=other)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    # A file already in the module's layout is read as it is, hf_model or not (no conversion reported)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    report = load_pretrained(tmp_path / "m.safetensors", _family("mixtral").state_dict(), hf_model=module)
    assert report.format == "safetensors"


def test_an_op_that_cannot_convert_is_refused_naming_op_and_model(mixtral, monkeypatch):
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    real, extra = cm.get_model_conversion_mapping, []
    monkeypatch.setattr(cm, "get_model_conversion_mapping", lambda model, *a, **k: [*extra, *real(model, *a, **k)])
    module = _family("mixtral")
    # stacked w2 is [E, H, I]: it has no dim 3 to transpose
    extra[:] = [WeightConverter(".experts.*.w2.weight", ".experts.down_proj",
                                operations=[MergeModulelist(dim=0), Transpose(0, 3)])]  # fmt: skip
    with pytest.raises(PretrainedError, match=r"MixtralForCausalLM mapping cannot convert .*experts.0.w2.weight.* "
                                              r"\(MergeModulelist -> Transpose\).*save model.state_dict"):  # fmt: skip
        load_pretrained(mixtral, module.state_dict(), hf_model=module)
    # one target made by two converters (w1 here, w3 by Mixtral's own): refused, not silently half-converted
    extra[:] = [WeightConverter(".experts.*.w1.weight", ".experts.gate_up_proj", operations=[MergeModulelist(dim=0)])]
    with pytest.raises(PretrainedError, match=r"two converters .* make model.layers.0.mlp.experts.gate_up_proj"):
        load_pretrained(mixtral, module.state_dict(), hf_model=module)


def test_export_hf_of_stacked_experts_loads_with_from_pretrained(mixtral, tmp_path):
    """transformers reads the stacked names (``experts.gate_up_proj``) as they are: the export writes them as held."""
    from transformers import AutoModelForCausalLM

    from lightning_par.checkpoint.dcp import save_sharded
    from lightning_par.checkpoint.export_hf import export_hf

    torch.manual_seed(3)
    module = _family("mixtral")
    save_sharded(tmp_path / "ckpt", {"state_dict": module.state_dict()}, {"epoch": 0}, rank=0)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", config=mixtral)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert [k for k, v in module.model.state_dict().items() if not torch.equal(loaded[k], v)] == []
    back = _family("mixtral")  # and our reader takes it back with no conversion
    assert "converted" not in load_pretrained(tmp_path / "hf", back.state_dict(), hf_model=back).format
    assert all(torch.equal(back.state_dict()[k], v) for k, v in module.state_dict().items())


# ---- two ranks ---------------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, store: str, folder: Path, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from lightning_par.checkpoint.dcp import model_state

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    result: dict[str, Any] = {}
    want = _reference(folder)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))

    def bad(views: dict[str, Any]) -> list[str]:
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in views.items()}
        return [k for k, v in want.items() if not torch.equal(full[f"model.{k}"], v)]

    # Expert shards as ExpertParallel.distribute wraps them: this rank's rows, Shard(0) over ep, the full shape
    torch.manual_seed(10 + rank)
    ep = _family("mixtral")
    views: dict[str, Any] = dict(ep.state_dict())
    for name, value in list(views.items()):
        if ".experts." in name:
            rows = value.shape[0] // world
            local = value[rank * rows : (rank + 1) * rows].clone()
            views[name] = DTensor.from_local(local, mesh, (Shard(0),), shape=value.shape, stride=value.stride(),
                                             run_check=False)  # fmt: skip
    report = load_pretrained(folder, views, hf_model=ep)
    result["ep"] = {"bad": bad(views), "line": str(report)}
    # FSDP2 over the layers and the Hugging Face model itself (re-classed as FSDPMixtralForCausalLM)
    torch.manual_seed(20 + rank)
    fsdp = _family("mixtral")
    for layer in fsdp.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp.model, mesh=mesh)
    result["fsdp_class"] = type(fsdp.model).__name__
    fviews = model_state(fsdp)
    report = load_pretrained(folder, fviews, hf_model=fsdp)
    result["fsdp"] = {"bad": bad(fviews), "line": str(report), "read": report.bytes_read}
    try:  # without the model: refused on every rank alike, before any read, nobody hangs
        load_pretrained(folder, fviews)
    except PretrainedError as err:
        result["refused"] = str(err)
    torch.save(result, f"{out}.{rank}")
    clean_exit()  # barrier, teardown, os._exit: gloo ranks may abort at interpreter exit (docs/testing.md)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_expert_sharded_and_fsdp2_views_read_bitwise_on_two_ranks(mixtral, tmp_path):
    out = tmp_path / "result"
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), mixtral, str(out)), nprocs=2, start_method="spawn")
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    total = sum(v.numel() * v.element_size() for v in _reference(mixtral).values())
    for rank, result in enumerate(results):
        assert result["ep"]["bad"] == [] and result["fsdp"]["bad"] == [], (rank, result)
        assert result["fsdp_class"].startswith("FSDP") and "converted from" in result["fsdp"]["line"]
        assert result["fsdp"]["read"] < total  # non-expert tensors still read only this rank's rows
        assert "does not fit" in result["refused"] and result["refused"] == results[0]["refused"]
