"""Precision plugin: Lightning hands our strategies their own plugin (real fp16 on CPU), and the sharded grad
scaler skips the step on every rank when any rank's gradient shard overflowed."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.trainer.connectors import accelerator_connector

import lightning_par
from lightning_par.precision.parallel import ParallelPrecision, ShardedGradScaler
from lightning_par.utils import clean_exit


def test_connector_patch_is_installed():
    method = accelerator_connector._AcceleratorConnector._check_and_init_precision
    assert getattr(method, "_lightning_par_patched", False), "Lightning moved _check_and_init_precision"


@pytest.mark.parametrize("flag", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_flag_maps_to_our_plugin_without_downgrade(flag):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Lightning's "16-mixed is not supported on CPU" must not fire
        trainer = L.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision=flag, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ParallelPrecision) and plugin.precision == flag
    assert isinstance(plugin.scaler, ShardedGradScaler) == (flag == "16-mixed")


def test_other_strategies_are_untouched():
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    assert not isinstance(trainer.precision_plugin, ParallelPrecision)


def test_plugin_dtypes():
    bf16_true, mixed = ParallelPrecision("bf16-true"), ParallelPrecision("16-mixed")
    assert bf16_true.param_dtype == torch.bfloat16 and not bf16_true.mixed
    assert mixed.param_dtype == torch.float32 and mixed.compute_dtype == torch.float16 and mixed.mixed
    model = bf16_true.convert_module(torch.nn.Linear(2, 2))
    assert model.weight.dtype == torch.bfloat16
    assert bf16_true.convert_input(torch.ones(2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="choose one of"):
        ParallelPrecision("8-true")


def _scaler_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    results = []
    for step in range(2):
        opt.zero_grad()
        (scaler.scale(p.sum())).backward()
        if step == 0 and rank == 1:
            p.grad[0] = float("inf")  # only rank 1's shard overflows
        scaler.step(opt)
        scaler.update()
        results.append((p.detach().clone(), scaler.get_scale()))
    if rank == 0:
        torch.save(results, out)
    clean_exit()  # barrier, teardown, os._exit: gloo ranks may abort at interpreter exit (docs/testing.md)


@pytest.mark.slow
def test_sharded_scaler_skips_the_step_on_all_ranks(tmp_path):
    out = str(tmp_path / "scaler.pt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_scaler_worker, args=(str(tmp_path / "init"), out), nprocs=2, start_method="spawn")
    (p0, scale0), (p1, scale1) = torch.load(out)
    # Step 0: rank 1 overflowed, so rank 0 (finite gradients) must also skip and halve the scale.
    assert torch.equal(p0, torch.ones(4)) and scale0 == 2.0**7
    # Step 1: finite everywhere, the unscaled gradient 1.0 is applied.
    assert torch.equal(p1, torch.zeros(4)) and scale1 == 2.0**7


def test_package_exports():
    assert lightning_par.ParallelPrecision is ParallelPrecision
