"""fp8's all-gather of sequence-parallel region inputs (`lightning_par.parallel.fp8.sequence`) on 2 gloo ranks.

An MLP region (gate, up: column-split fp8 projections; down: row-split) under tensor and sequence parallelism, its
input gathered by `region_input` two ways: DTensor's gather of the training-precision shard (what runs without fp8
or for regions not ready), and fp8's gather of the shard cast with the whole tensor's scale. The projections see the
same fp8 values and scale, so the outputs, the input gradients and the weight gradients must be bitwise equal, in
fp32 and under bf16 autocast, with a sequence tp divides and with one it does not (7 tokens over 2 ranks: the
stream padded, the region's input cut back). The gathers' bytes (`CommCounter`): fp8's is 1 byte a value against
4 (fp32 stream) = 0.25, besides one scalar all-reduce of the amax. Checked to fail: the cast without the amax's
all-reduce (each rank's own scale) changes the outputs.

The probe (`gather_ready`, one process): a Hugging Face Llama's attention and MLP regions are ready (their inputs
reach only their fp8 projections); GPT's attention is not (its fused projection stays in the training precision),
its MLP is; a region whose code reads its input outside its projections (a norm inside it) is not.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_par.utils import clean_exit

WORLD = 2


class _MLP(nn.Module):
    def __init__(self, inner_norm: bool = False) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False), nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32) if inner_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _run(x_local: torch.Tensor, region: nn.Module, mesh: Any, length: int, gather: Any,
         counter: Any) -> tuple[torch.Tensor, ...]:  # fmt: skip
    from lightning_par.parallel.tensor.sequence import SequenceState, region_input

    x = x_local.clone().requires_grad_(True)
    counter.phase = "gather"  # the region's input gather alone (the backward all-gathers the output's gradient)
    args, _ = region_input(mesh, SequenceState(length), 32, region, (x,), {}, gather=gather)
    counter.phase = "rest"
    out = region(*args)
    out.float().pow(2).sum().backward()
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in region.parameters()]
    return (out.detach(), x.grad, *grads)


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_par.parallel.comm_counter import CommCounter
    from lightning_par.parallel.fp8 import fp8_gathers

    mesh = init_device_mesh("cpu", (WORLD,))
    report: dict[str, Any] = {}
    torch.manual_seed(0)
    base = _MLP()
    for length in (8, 7):
        x = torch.randn(8, length, 32)
        per = -(-length // WORLD)
        padded = torch.nn.functional.pad(x, (0, 0, 0, per * WORLD - length))
        x_local = padded[:, rank * per : (rank + 1) * per]
        for autocast in (False, True):
            runs, wire = [], []
            for fp8 in (False, True):
                counter = CommCounter()  # installed before the DTensors exist: it learns the group from them
                counter.install()
                region = copy.deepcopy(base)
                convert_to_float8_training(region, config=Float8LinearConfig(emulate=True),
                                           module_filter_fn=lambda m, n: n in ("gate", "up", "down"))  # fmt: skip
                parallelize_module(region, mesh, {"gate": ColwiseParallel(use_local_output=True),
                                                  "up": ColwiseParallel(use_local_output=True),
                                                  "down": RowwiseParallel(output_layouts=Shard(1),
                                                                          use_local_output=True)})  # fmt: skip
                wrapper = nn.Module()
                wrapper.mlp = region
                gather = fp8_gathers(wrapper, {"mlp": "mlp.gate"})("mlp") if fp8 else None
                try:
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        runs.append(_run(x_local, region, mesh, length, gather, counter))
                finally:
                    counter.uninstall()
                wire.append({k: v for (ph, k, _), v in counter.bytes.items() if ph == "gather"})
                calls = {k: n for (ph, k, _), n in counter.calls.items() if ph == "gather"}
            same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
            report[f"{length}_{autocast}"] = {"same": same, "gather": [w.get("all_gather", 0.0) for w in wire],
                                              "amax": calls.get("all_reduce", 0)}
    torch.save(report, f"{out}.{rank}")
    clean_exit()


@pytest.mark.slow
def test_fp8_gather_matches_the_training_precision_gather_at_a_quarter_of_the_bytes(tmp_path: Path) -> None:
    out = str(tmp_path / "report")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        report = torch.load(f"{out}.{rank}")
        assert set(report) == {"8_False", "8_True", "7_False", "7_True"}
        for case, got in report.items():
            assert got["same"], (rank, case)
            exact, fp8 = got["gather"]
            assert exact > 0 and fp8 == pytest.approx(exact / 4), (rank, case, got)  # fp32 stream: 4 bytes -> 1
            assert got["amax"] == 1, (rank, case, got)  # and one scalar all-reduce: the whole tensor's amax


def test_the_probe_finds_the_regions_only_fp8_projections_read() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _job_models import MODELS

    from lightning_par.blocks.trunk import find_trunk
    from lightning_par.parallel.fp8 import gather_ready, select_fp8
    from lightning_par.parallel.tensor.plan import infer_tp_plan

    def ready(model: nn.Module) -> set[str]:
        plan = infer_tp_plan(model)
        layers = select_fp8(model, find_trunk(model), [], [plan], 2)
        return set(gather_ready(model, [plan], set(layers.converted)))

    llama = ready(MODELS["hf_llama_sgd"]())
    assert llama == {f"model.model.layers.{i}.{r}" for i in (0, 1) for r in ("self_attn", "mlp")}
    gpt = ready(MODELS["gpt"]())
    assert gpt == {"transformer.h.0.mlp", "transformer.h.1.mlp"}  # c_attn (fused) stays in the training precision
    gpt_normed = MODELS["gpt"]()
    for block in gpt_normed.transformer.h:  # the MLP's own code normalises its input before the projection
        forward = block.mlp.forward
        block.mlp.forward = lambda x, _f=forward: _f(torch.nn.functional.layer_norm(x, (32,)))
    assert ready(gpt_normed) == set()  # the norm reads the region's input: neither MLP is ready
