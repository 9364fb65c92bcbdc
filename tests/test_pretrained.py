"""Pretrained weights into any layout (checkpoint/pretrained*.py) and back out to a Hugging Face folder
(checkpoint/export_hf.py). Tiny Hugging Face models are built from configs and saved with ``save_pretrained``: no
downloads. One 2-rank and one 4-rank spawn check every layout (FSDP2, tensor parallel, both nested, fused qkv,
a sharded lightning_par checkpoint as the source) bitwise against the file, and that each rank reads less than the
model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.checkpoint import export_hf
from lightning_par.checkpoint.consolidate import main as consolidate_main
from lightning_par.checkpoint.pretrained.load import PretrainedError, load_pretrained
from lightning_par.checkpoint.pretrained.names import PrefixRewrite, choose_rewrite
from lightning_par.utils import clean_exit

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _llama_config(tied: bool, hidden: int = 32) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip


def _llama(tied: bool = False, seed: int = 0, hidden: int = 32) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tied, hidden))
    with torch.no_grad():  # norms start at ones, biases at zeros: make every tensor distinct from a fresh model
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


class Wrapper(nn.Module):
    """What a LightningModule looks like from here: the Hugging Face model under ``self.model``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {"llama": root / "llama", "tied": root / "tied", "sharded": root / "sharded", "gpt2": root / "gpt2"}
    _llama().save_pretrained(out["llama"])
    _llama(tied=True).save_pretrained(out["tied"])
    _llama().save_pretrained(out["sharded"], max_shard_size="20KB")
    _gpt2().save_pretrained(out["gpt2"])
    return out


def _file(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(folder / shard))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str = "") -> None:
    for key, value in want.items():
        assert torch.equal(got[prefix + key], value), key


# ---- one process -------------------------------------------------------------------------------------------------
def test_plain_module_and_sharded_index_are_bitwise_the_file(files):
    for name, kind in (("llama", "hf"), ("sharded", "hf-sharded")):
        model = _llama(seed=1)
        report = load_pretrained(files[name], model.state_dict())
        _assert_equal(model.state_dict(), _file(files[name]))
        assert report.rewrite == PrefixRewrite() and report.tensors == len(model.state_dict())
        assert report.format.startswith(kind) and report.bytes_read == sum(
            v.numel() * 4 for v in _file(files[name]).values()
        )
    assert "files" in report.format and str(report).startswith("pretrained weights: ")


def test_wrapper_prefix_tied_head_and_base_prefix(files):
    wrapped = Wrapper(_llama(tied=True, seed=1))
    report = load_pretrained(files["tied"], wrapped.state_dict())
    assert report.rewrite == PrefixRewrite(module="model.") and report.tied == ("model.lm_head.weight",)
    _assert_equal(wrapped.state_dict(), _file(files["tied"]), prefix="model.")
    assert (
        "lm_head.weight" not in _file(files["tied"])
        and wrapped.model.lm_head.weight is wrapped.model.get_input_embeddings().weight
    )
    base = _llama(tied=True, seed=2).model  # LlamaModel: the file's "model." prefix is not in its names
    report = load_pretrained(files["tied"], base.state_dict())
    assert report.rewrite == PrefixRewrite(file="model.")
    assert torch.equal(base.norm.weight, _file(files["tied"])["model.norm.weight"])
    with pytest.raises(PretrainedError, match=r"1 file tensor\(s\) the module lacks: lm_head.weight.*strict=False"):
        load_pretrained(files["llama"], _llama(seed=2).model.state_dict())
    report = load_pretrained(files["llama"], base.state_dict(), strict=False)
    assert report.skipped == ("lm_head.weight",) and "strict=False skipped 1" in str(report)


def test_dtype_cast_recomputed_buffers_and_lightning_files(files, tmp_path):
    model = _llama(seed=1).to(torch.bfloat16)
    load_pretrained(files["llama"], model.state_dict())
    _assert_equal({k: v.float() for k, v in model.state_dict().items()},
                  {k: v.bfloat16().float() for k, v in _file(files["llama"]).items()})  # fmt: skip
    old = {**_file(files["llama"]), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    save_file(old, str(tmp_path / "old.safetensors"))
    report = load_pretrained(tmp_path / "old.safetensors", _llama(seed=1).state_dict())
    assert report.ignored == ("model.layers.0.self_attn.rotary_emb.inv_freq",) and report.format == "safetensors"
    # consolidate's OUT: a Lightning checkpoint file (memory-mapped), and OUT.safetensors next to it when there
    wrapped = {f"model.{k}": v for k, v in _file(files["llama"]).items()}
    torch.save({"state_dict": wrapped, "epoch": 3}, tmp_path / "out.ckpt")
    target = Wrapper(_llama(seed=1))
    assert load_pretrained(tmp_path / "out.ckpt", target.state_dict()).format == "torch"
    _assert_equal(target.state_dict(), wrapped)
    save_file(wrapped, str(tmp_path / "out.ckpt.safetensors"))
    assert load_pretrained(tmp_path / "out.ckpt", Wrapper(_llama(seed=1)).state_dict()).format == "safetensors"


def _damage(case: str, files: dict[str, Path], tmp: Path) -> tuple[Path, nn.Module]:
    if case == "missing shard":
        folder = tmp / "sharded"
        folder.mkdir()
        for f in files["sharded"].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        sorted(folder.glob("model-00002-of-*.safetensors"))[0].unlink()
        return folder, _llama()
    if case == "truncated":
        data = (files["llama"] / "model.safetensors").read_bytes()
        (tmp / "model.safetensors").write_bytes(data[: len(data) // 2])
        return tmp, _llama()
    if case == "unknown format":
        (tmp / "pytorch_model.bin").write_bytes(b"not read")
        return tmp, _llama()
    if case == "other size":
        return files["llama"], _llama(hidden=48)
    state = _file(files["llama"])
    if case == "missing key":
        state.pop("model.layers.1.mlp.up_proj.weight")
    else:
        state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(state, str(tmp / "model.safetensors"))
    return tmp, _llama()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing shard", r"model-00002-of-\d+.safetensors is missing: .*index.json lists it"),
        ("truncated", r"model.safetensors is not a readable safetensors file .*truncated or corrupt"),
        ("unknown format", r"holds pytorch_model.bin: not a pretrained checkpoint \(pickled .bin"),
        ("other size", r"model.embed_tokens.weight: file \[64, 32\] vs model \[64, 48\]"),
        ("missing key", r"1 module tensor\(s\) missing from the file: model.layers.1.mlp.up_proj.weight"),
        ("unexpected key", r"1 file tensor\(s\) the module lacks: model.layers.2.mlp.up_proj.weight"),
    ],
)
def test_bad_inputs_are_refused_naming_the_file(case, message, files, tmp_path):
    path, model = _damage(case, files, tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedError, match=message) as err:
        load_pretrained(path, model.state_dict())
    assert str(path) in str(err.value)
    _assert_equal(model.state_dict(), before)  # refused before anything was read


def test_prefix_choice_prefers_the_shortest_best_rewrite():
    names = ["model.model.layers.0.w", "model.model.norm.w", "model.lm_head.w"]
    assert choose_rewrite(names, ["model.layers.0.w", "model.norm.w", "lm_head.w"]) == PrefixRewrite(module="model.")
    assert choose_rewrite(["backbone.layers.0.w"], ["model.layers.0.w"]) == PrefixRewrite("backbone.", "model.")
    assert choose_rewrite(["a.w"], ["b.v"]) == PrefixRewrite()


# ---- export to a Hugging Face folder ----------------------------------------------------------------------------
def _dcp_of(model: nn.Module, path: Path) -> Path:
    from lightning_par.checkpoint.dcp import save_sharded

    save_sharded(path, {"state_dict": model.state_dict()}, {"epoch": 0}, rank=0)
    return path


def test_export_hf_streams_shard_by_shard_and_loads_with_from_pretrained(files, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    source = Wrapper(_llama(tied=True, seed=3))
    ckpt = _dcp_of(source, tmp_path / "ckpt")
    events: list[tuple[str, int]] = []
    real_load = export_hf.safe_load
    monkeypatch.setattr(
        export_hf, "safe_load", lambda flat, *a, **k: events.append(("read", len(flat))) or real_load(flat, *a, **k)
    )

    def record(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
        events.append(("write", sum(t.numel() * t.element_size() for t in tensors.values())))
        save_file(tensors, path, metadata=metadata)

    written = export_hf.export_hf(ckpt, tmp_path / "hf", config=files["tied"], max_shard_size="20KB", save_file=record)
    assert [e for e, _ in events] == ["read", "write"] * (len(events) // 2) and len(events) > 4
    assert all(size <= 20_000 or n == 1 for (_, n), (_, size) in zip(events[::2], events[1::2], strict=True))
    names = {p.name for p in written}
    assert {"model.safetensors.index.json", "config.json"} <= names
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map  # tied: written once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    _assert_equal(loaded.state_dict(), {k[len("model.") :]: v for k, v in source.state_dict().items()})
    # The CLI: one file by default without a config (names: the one shared first part, "model.", taken off)
    consolidate_main([str(ckpt), str(tmp_path / "cli"), "--format", "hf"])
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["model.safetensors"]
    assert set(load_file(tmp_path / "cli" / "model.safetensors")) == {k[6:] for k in source.state_dict()}
    with pytest.raises(SystemExit):
        consolidate_main([str(ckpt), str(tmp_path / "cli"), "--format", "hf"])  # OUT is not empty
    with pytest.raises(SystemExit):
        consolidate_main([str(ckpt), str(tmp_path / "p"), "--format", "hf", "--prefix", "nope."])


# ---- several ranks -----------------------------------------------------------------------------------------------
def _init(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)


def _compare(views: dict[str, Any], want: dict[str, torch.Tensor], prefix: str = "") -> list[str]:
    from lightning_par.checkpoint.strided import full_tensor

    return [k for k, v in want.items() if not torch.equal(full_tensor(views[prefix + k]), v)]


def _tp_llama(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cols = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    plan: dict[str, Any] = {k: ColwiseParallel() for k in cols}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def _worker(rank: int, world: int, store: str, files: dict[str, Path], out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_par.checkpoint.dcp import model_state, save_sharded
    from lightning_par.checkpoint.strided import is_fused
    from lightning_par.parallel.tensor.apply import apply_tensor_parallel
    from lightning_par.parallel.tensor.plan import infer_tp_plan

    _init(rank, world, store)
    result: dict[str, Any] = {}
    tied, gpt2 = _file(files["tied"]), _file(files["gpt2"])
    total = {k: sum(v.numel() * 4 for v in f.values()) for k, f in (("tied", tied), ("gpt2", gpt2))}
    dims = ("dp", "tp") if world == 4 else None
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims) if dims else None

    def layouts() -> dict[str, tuple[nn.Module, str]]:
        if mesh2 is None:
            dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        else:
            dp, tp = mesh2["dp"], mesh2["tp"]
        built: dict[str, tuple[nn.Module, str]] = {}
        fsdp = Wrapper(_llama(tied=True, seed=5))
        fully_shard(fsdp, mesh=dp)
        built["fsdp"] = (fsdp, "tied")
        tpm = Wrapper(_llama(tied=True, seed=5))
        _tp_llama(tpm.model, tp)
        if mesh2 is not None:
            fully_shard(tpm, mesh=dp)  # tp then ZeRO-3 over dp, as compose orders them
        built["tp"] = (tpm, "tied")
        fused = Wrapper(_gpt2(seed=5))
        apply_tensor_parallel(fused, tp, infer_tp_plan(fused), sequence_parallel=False)
        if mesh2 is not None:
            fully_shard(fused, mesh=dp)
        built["fused"] = (fused, "gpt2")
        return built

    built = {name: (model_state(model), file) for name, (model, file) in layouts().items()}
    for name, (views, file) in built.items():
        report = load_pretrained(files[file], views)
        want = tied if file == "tied" else gpt2
        result[name] = {"bad": _compare(views, want, "model."), "read": report.bytes_read, "total": total[file],
                        "fused": any(is_fused(v) for v in views.values()), "line": str(report)}  # fmt: skip
        if name in ("tp", "fused"):  # a sharded lightning_par checkpoint of this layout, read back into another
            save_sharded(Path(out).with_name(f"ckpt_{world}_{name}"), {"state_dict": views}, {}, rank)
    for name, (views, file) in built.items():
        with torch.no_grad():
            for v in views.values():
                (v.to_local() if isinstance(v, DTensor) else v).zero_()
        src = "tp" if file == "tied" else "fused"  # fsdp reads tp's checkpoint, each other one its own
        report = load_pretrained(Path(out).with_name(f"ckpt_{world}_{src}"), views)
        want = tied if file == "tied" else gpt2
        result[f"dcp_{name}"] = {"bad": _compare(views, want, "model."), "format": report.format}
    # A file that does not fit fails on every rank, with one message, and nobody hangs
    try:
        load_pretrained(files["gpt2"], built["fsdp"][0])
    except PretrainedError as err:
        result["refused"] = str(err)
    torch.save(result, f"{out}.{rank}")
    clean_exit()  # barrier, teardown, os._exit: gloo ranks may abort at interpreter exit (docs/testing.md)


def _spawn(world: int, files: dict[str, Path], tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "result"
    mp.start_processes(_worker, args=(world, str(tmp / "store"), files, str(out)), nprocs=world, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_reads_its_own_part_bitwise(world, files, tmp_path):
    results = _spawn(world, files, tmp_path)
    for rank, result in enumerate(results):
        for name in ("fsdp", "tp", "fused", "dcp_fsdp", "dcp_tp", "dcp_fused"):
            assert result[name]["bad"] == [], (rank, name, result[name])
        assert result["fused"]["fused"]  # the GPT-2 c_attn really is a _StridedShard view
        for name in ("fsdp", "tp"):  # sliced reads: every rank reads well under the model
            assert result[name]["read"] < 0.75 * result[name]["total"], (rank, name, result[name])
        assert result["fused"]["read"] < result["fused"]["total"]
        assert result["dcp_tp"]["format"].startswith("dcp")
        assert "does not fit" in result["refused"] and result["refused"] == results[0]["refused"]
