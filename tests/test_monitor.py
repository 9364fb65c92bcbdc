"""ParallelismMonitor on one CPU process: exact memory counts, token accounting, the MFU formula, layout logging."""

import csv
import itertools
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.callbacks import ParallelismMonitor, peak_flops_for
from lightning_par.callbacks import monitor as monitor_mod

VOCAB, WIDTH, SEQ, BATCH = 32, 16, 8, 4


class TinyLM(L.LightningModule):
    def __init__(self, with_shape: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        if with_shape:
            self.n_layers, self.hidden_size, self.seq_len = 2, WIDTH, SEQ

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(torch.relu(self.fc(self.emb(x))))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LayoutStrategy(SingleDeviceStrategy):
    """A one-device strategy that reports the attributes a data-parallel strategy would."""

    dp_size = 4
    global_param_count = 1000
    parallel_layout: ClassVar[dict[str, int]] = {"dp_shard": 4, "tp": 1}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=BATCH)


def _fit(tmp_path: Path, cb: ParallelismMonitor, model: TinyLM | None = None, **trainer_kw: Any) -> TinyLM:
    model = model or TinyLM()
    kw: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "max_steps": 4, "log_every_n_steps": 1}
    kw.update(trainer_kw)
    kw.setdefault("logger", CSVLogger(tmp_path, name="run"))
    trainer = L.Trainer(
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        **kw,
    )
    trainer.fit(model, _loader())
    return model


def _non_embedding(model: TinyLM) -> int:
    return sum(p.numel() for p in itertools.chain(model.fc.parameters(), model.head.parameters()))


def test_metrics_exact(tmp_path: Path) -> None:
    cb = ParallelismMonitor(peak_flops=1e12)
    model = _fit(tmp_path, cb)
    m = cb.last_metrics
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert m["mem/params_bytes"] == param_bytes
    assert m["mem/grads_bytes"] == param_bytes
    # AdamW: exp_avg and exp_avg_sq like each fp32 param, plus a 4-byte fp32 `step` tensor per param.
    assert m["mem/optim_state_bytes"] == sum(2 * p.numel() * 4 + 4 for p in params)
    assert m["mem/params_bytes_max_rank"] == param_bytes  # one rank: the max is its own value

    n = _non_embedding(model)
    assert cb.n_params == n and n < sum(p.numel() for p in params)
    flops_per_token = 6 * n + 12 * 2 * WIDTH * SEQ
    assert cb.flops_per_token == flops_per_token
    assert 0 < m["perf/tokens_per_s"] < float("inf")
    assert m["perf/mfu"] == pytest.approx(flops_per_token * m["perf/tokens_per_s"] / 1 / 1e12, rel=1e-12)
    assert m["perf/model_tflops_per_s_per_device"] == pytest.approx(m["perf/mfu"], rel=1e-12)  # peak is 1 TFLOP/s
    assert "mem/cuda_max_allocated_bytes" not in m

    log_dir = Path(tmp_path, "run", "version_0")
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["parallel"] == {"strategy": "SingleDeviceStrategy", "world_size": 1}
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    logged = [r for r in rows if r.get("perf/tokens_per_s")]
    assert [int(r["step"]) for r in logged] == [0, 1, 2, 3]  # one row per optimizer step
    assert float(logged[-1]["mem/params_bytes"]) == param_bytes


@pytest.mark.parametrize(("accumulate", "every"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_tokens_per_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulate: int, every: int
) -> None:
    tick = 0.25
    clock = itertools.count()
    # The monitor reads the clock once when timing starts and once per log, so each window lasts one tick.
    monkeypatch.setattr(monitor_mod, "perf_counter", lambda: next(clock) * tick)
    cb = ParallelismMonitor(log_every_n_steps=every, peak_flops=1e12)
    _fit(tmp_path, cb, accumulate_grad_batches=accumulate)
    assert cb.last_metrics["perf/tokens_per_s"] == BATCH * SEQ * accumulate * every / tick


def test_strategy_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count()
    monkeypatch.setattr(monitor_mod, "perf_counter", lambda: float(next(clock)))
    cb = ParallelismMonitor(peak_flops=1e12)
    _fit(tmp_path, cb, strategy=LayoutStrategy(torch.device("cpu")))
    assert cb.last_metrics["perf/tokens_per_s"] == BATCH * SEQ * 4  # dp_size multiplies, world_size is 1
    assert cb.n_params == 1000
    hparams = yaml.safe_load(Path(tmp_path, "run", "version_0", "hparams.yaml").read_text())
    assert hparams["parallel"] == {"dp_shard": 4, "tp": 1}


def test_no_shape_no_peak(tmp_path: Path) -> None:
    cb = ParallelismMonitor()
    model = TinyLM(with_shape=False)
    with pytest.warns(UserWarning, match="MFU counts only 6N"):
        _fit(tmp_path, cb, model=model, max_steps=2)
    assert cb.flops_per_token == 6 * _non_embedding(model)
    assert "perf/mfu" not in cb.last_metrics  # CPU and no peak_flops: no MFU
    tflops = cb.flops_per_token * cb.last_metrics["perf/tokens_per_s"] / 1e12
    assert cb.last_metrics["perf/model_tflops_per_s_per_device"] == pytest.approx(tflops, rel=1e-12)


def test_shape_overrides(tmp_path: Path) -> None:
    cb = ParallelismMonitor(n_layers=3, hidden_size=5, seq_len=7)
    model = _fit(tmp_path, cb, max_steps=1)
    assert cb.flops_per_token == 6 * _non_embedding(model) + 12 * 3 * 5 * 7


# Dense peaks derived from the vendors' published figures, not read from the table under test. NVIDIA's
# datasheets list tensor rates "with sparsity" (2:4 structured sparsity doubles them): the dense rate is half.
# H100 SXM5 datasheet: BF16 / FP16 1,979 TFLOPS, TF32 989 (sparse); H100 PCIe: FP16 1,513 (sparse); H200 SXM: as
# H100 SXM (same GH100 compute); A100 datasheet: FP32 19.5, TF32 312 (sparse); Ada whitepaper, RTX 4090: FP16 /
# BF16 with FP32 accumulate 330.3 (sparse); V100 SXM2 datasheet: tensor 125, FP32 15.7 (no sparsity, no TF32).
PUBLISHED = [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 1979e12 / 2),
    ("NVIDIA H100 80GB HBM3", "tf32", 989e12 / 2),
    ("NVIDIA H100 PCIe", "16-mixed", 1513e12 / 2),
    ("NVIDIA H200", "bf16-true", 1979e12 / 2),
    ("NVIDIA A100-SXM4-80GB", "32-true", 19.5e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 312e12 / 2),
    ("NVIDIA GeForce RTX 4090", "bf16-mixed", 330.3e12 / 2),
    ("Tesla V100-SXM2-16GB", "16-mixed", 125e12),
    ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # no tf32 units: the fp32 rate
]


@pytest.mark.parametrize(("device", "precision", "published"), PUBLISHED)
def test_peak_flops_follow_the_published_figures(device: str, precision: str, published: float) -> None:
    # The datasheets round to 3-4 significant figures (989 for 989.4, 1,979 for 1,978.9).
    assert peak_flops_for(device, precision) == pytest.approx(published, rel=2e-3)


def test_peak_flops_table() -> None:
    assert peak_flops_for("Tesla V100-SXM2-16GB", "bf16-mixed") is None
    assert peak_flops_for("NVIDIA RTX A1000", "bf16-mixed") is None  # not an A100
    assert peak_flops_for("NVIDIA L40S", "bf16-mixed") is None  # not an L4
    assert peak_flops_for("Some Future GPU", "bf16-mixed") is None
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "64-true") is None


def test_bad_args_name_the_fix() -> None:
    with pytest.raises(ValueError, match="pass None to use the Trainer's"):
        ParallelismMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="peak_flops=-1"):
        ParallelismMonitor(peak_flops=-1)


def test_grads_bytes_count_the_gradients_zero_reduced_onto_the_optimizer(tmp_path: Path) -> None:
    # ZeRO-1 hands the reduced gradients to the tensors the optimizer steps (its masters; here, at one rank, views of
    # whole parameters) and frees the model's: the gradient memory is still there and is counted.
    cb = ParallelismMonitor(peak_flops=1e12)
    try:
        model = _fit(tmp_path, cb, strategy="zero1")
    finally:  # the strategy's one-rank process group, which later tests in this process would meet
        if dist.is_initialized():
            dist.destroy_process_group()
    assert all(p.grad is None for p in model.parameters())
    assert cb.last_metrics["mem/grads_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_local_bytes_dedupes_views() -> None:
    flat = torch.zeros(10)  # a flat buffer and views of it, as ZeRO or DDP bucket views hold them: 40 bytes
    assert monitor_mod._local_bytes([flat, flat[:5], flat.view(2, 5), None, torch.zeros(3, device="meta")]) == 40


def test_dtensor_counts_local_shard(tmp_path: Path) -> None:
    # One process posing as rank 0 of 2: a local shard of 10 floats of a global (20,) tensor.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = DTensor.from_local(
            torch.zeros(10), mesh, [Shard(0)], run_check=False, shape=torch.Size([20]), stride=(1,)
        )
        assert shard.numel() == 20  # the global count, which the monitor's N relies on
        assert monitor_mod._local_bytes([shard]) == 10 * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")
def test_cuda_peak_lookup(tmp_path: Path) -> None:
    peak = peak_flops_for(torch.cuda.get_device_name(), "bf16-mixed")
    cb = ParallelismMonitor()
    _fit(tmp_path, cb, accelerator="cuda", precision="bf16-mixed", max_steps=2)
    assert cb.peak_flops == peak  # bf16-mixed resolves through the same table
    assert cb.last_metrics["mem/cuda_max_allocated_bytes"] >= cb.last_metrics["mem/params_bytes"]
    if peak is not None:
        expected = cb.flops_per_token * cb.last_metrics["perf/tokens_per_s"] / peak
        assert cb.last_metrics["perf/mfu"] == pytest.approx(expected, rel=1e-12)


class TinyMoELM(L.LightningModule):
    """Two blocks, each a `lightning_par.nn.MoE` (dropless, top-2 of 4), recomputed in backward."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_par.nn import MoE
        from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing

        self.emb = nn.Embedding(VOCAB, WIDTH)
        # The MoE layer inside each block with work after it, as in a transformer: a recomputed block calls it
        # again (torch stops a recomputation once the last saved tensor is back, so a last layer may be spared).
        self.blocks = nn.ModuleList(
            [nn.Sequential(MoE(WIDTH, 24, 4, 2, aux_loss_coef=0.0), nn.Linear(WIDTH, WIDTH)) for _ in range(2)]
        )
        self.head = nn.Linear(WIDTH, VOCAB)
        apply_activation_checkpointing(list(self.blocks), "full")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_expert_load_counts_each_token_once(tmp_path: Path) -> None:
    # Summed over the accumulation window, recomputed forwards not counted again: every token's top-2 assignments
    # of the logged step, once. A dense model logs no experts/ values.
    cb = ParallelismMonitor()
    _fit(tmp_path, cb, TinyMoELM(), accumulate_grad_batches=2)  # type: ignore[arg-type]
    assert set(cb.expert_load) == {"blocks.0.0", "blocks.1.0"}
    for v in cb.expert_load.values():
        assert float(v["tokens_per_expert"].sum()) == 2 * BATCH * SEQ * 2 and v["dropped_fraction"] == 0.0
    m = cb.last_metrics
    assert m["experts/load_max_over_mean"] == max(m[f"experts/blocks.{i}.0/load_max_over_mean"] for i in (0, 1)) >= 1
    dense = ParallelismMonitor()
    _fit(tmp_path / "dense", dense)
    assert dense.expert_load == {} and not any(k.startswith("experts/") for k in dense.last_metrics)


def test_model_flops_count_the_active_experts_only(tmp_path: Path) -> None:
    # top-2 of 4 experts: N leaves out the embedding and half of every layer's experts (router and the rest whole).
    from lightning_par.parallel.flops import active_param_count

    model = TinyMoELM()
    experts = sum(p.numel() for b in model.blocks for p in b[0].experts.parameters())
    everything = sum(p.numel() for p in model.parameters()) - model.emb.weight.numel()
    assert experts > 0 and active_param_count(model) == everything - experts // 2
    cb = ParallelismMonitor()
    _fit(tmp_path, cb, model, max_steps=1)  # type: ignore[arg-type]
    assert cb.flops_per_token == 6.0 * (everything - experts // 2)  # Lightning's own strategy: counted here


def test_pictures_reach_wandb_as_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read back from the offline run with wandb's own reader: each picture is an image record of the logged step,
    # its PNG in the run's files, decodable, and the pixels the callback drew.
    import json
    import subprocess
    import sys

    import numpy as np
    from lightning.pytorch.loggers import WandbLogger
    from PIL import Image

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # removed again after the test: wandb.init sets it
    monkeypatch.chdir(tmp_path)
    cb = ParallelismMonitor(pictures_every_n_steps=2)
    logger = WandbLogger(project="pictures", save_dir=str(tmp_path))
    _fit(tmp_path, cb, TinyMoELM(), logger=logger)  # type: ignore[arg-type]
    logger.experiment.finish()
    import wandb

    wandb.teardown()  # this process's W&B service: later tests' children must not find it
    assert set(cb.last_pictures) == {"pictures/memory_per_rank", "pictures/expert_load"}
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    reader = [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run)]
    read = subprocess.run(reader, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    history = [json.loads(line)["history"]["item"] for line in read.stdout.splitlines() if '"type":"history"' in line]
    shown = [h for h in history if "pictures/memory_per_rank._type" in h]
    # Optimizer steps 2 and 4, at the x Lightning gives their metrics (steps before them: 1 and 3), in one row each.
    assert [h["trainer/global_step"] for h in shown] == [1, 3]
    for key, drawn in cb.last_pictures.items():
        row = shown[-1]
        assert row[f"{key}._type"] == "image-file" and row[f"{key}.width"] == drawn.shape[1], row
        name = row[f"{key}.path"]
        assert np.array_equal(np.asarray(Image.open(run / "files" / name).convert("RGB")), drawn)
    heat = cb.last_pictures["pictures/expert_load"]
    # The loads it recorded, drawn: one row per MoE layer (a third layer adds as much height as the second did).
    from lightning_par.callbacks.pictures import load_heatmap

    loads = {k: v["tokens_per_expert"] for k, v in cb.expert_load.items()}
    assert len(loads) == 2 and np.array_equal(heat, load_heatmap(loads))
    one, three = load_heatmap(dict(list(loads.items())[:1])), load_heatmap({**loads, "x": loads["blocks.0.0"]})
    assert three.shape[0] - heat.shape[0] == heat.shape[0] - one.shape[0] > 0
    assert len({tuple(px) for px in heat.reshape(-1, 3)}) > 4  # shades, not a blank canvas


def test_pictures_reach_tensorboard(tmp_path: Path) -> None:
    # Read back from the event file with TensorBoard's own reader: the same pixels, at the metrics' step.
    import io

    import numpy as np
    from lightning.pytorch.loggers import TensorBoardLogger
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = ParallelismMonitor(pictures_every_n_steps=2)
    _fit(tmp_path, cb, TinyMoELM(), logger=TensorBoardLogger(tmp_path, name="tb"))  # type: ignore[arg-type]
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"images": 0})
    acc.Reload()
    assert set(cb.last_pictures) <= set(acc.Tags()["images"])
    for key, drawn in cb.last_pictures.items():
        shots = acc.Images(key)
        assert [s.step for s in shots] == [1, 3]
        decoded = np.asarray(Image.open(io.BytesIO(shots[-1].encoded_image_string)).convert("RGB"))
        assert np.array_equal(decoded, drawn)


def test_the_layout_degrees_are_logged_for_every_axis() -> None:
    # Each step's metrics carry the layout's degrees (parallel/pp, /tp, /ep, /cp, /dp), read from the strategy's
    # parallel_layout, which is ParallelConfig.layout() plus the world size.
    from lightning_par.config import ParallelConfig

    layout = ParallelConfig(pp=2, tp=2, cp=2, ep=2, zero_stage=1).resolve(16).layout()
    assert monitor_mod._degrees(layout) == {
        "parallel/pp": 2.0, "parallel/tp": 2.0, "parallel/ep": 2.0, "parallel/cp": 2.0, "parallel/dp": 2.0,
    }  # fmt: skip
