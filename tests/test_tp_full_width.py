"""Tensor parallelism for code that sizes its tensors from the full width (`lightning_par.parallel.tensor.full_width`).

nanoGPT's attention (``tests/_nano_models.py``) splits its fused ``c_attn`` by ``n_embd`` and views ``(B, T, C)`` with
``C = x.size(-1)``: per-rank head slices fail there. The check before training finds it on block 0 and marks that
attention to run on gathered outputs (its MLP, which runs on its slices, stays split by its hidden units); with
per-head q/k norms, which would need the heads split, it is refused naming a correct override. The two operators
(a split output gathered back to the whole projection's, parts in the model's order; a whole input's columns taken
for a row split) are checked on 2 gloo ranks against the whole projection, forward and backward. Parity of
whole trainings: `test_tp_families.py` (nanoGPT under tp, with and without its mask buffer) and
`test_pipeline_families.py` (nanoGPT under pp 2 x tp 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _nano_models import NanoGPT

from lightning_par.models import GPT
from lightning_par.parallel.tensor import TPPlanError, infer_tp_plan
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.full_width import _GatherColumns, _TakeColumns, as_whole, fallback_for
from lightning_par.utils import clean_exit


def test_nanogpt_attention_runs_on_gathered_outputs_and_its_mlp_stays_split() -> None:
    model = NanoGPT()
    plan = infer_tp_plan(model)
    assert plan.gathered == ()
    checked = check_local_shapes(model, plan, 2)
    assert checked.gathered == ("transformer.h.*.attn",)
    assert any(n.startswith("run on the full width: transformer.h.*.attn") for n in checked.notes)
    # The weights stay split; only the checks' view of the region (and its head counts) is whole.
    assert checked.styles["transformer.h.*.attn.c_attn"] == "colwise_fused"
    assert checked.styles["transformer.h.*.mlp.c_fc"] == "colwise"
    whole = as_whole(checked).styles
    assert whole["transformer.h.*.attn.c_attn"] == whole["transformer.h.*.attn.c_proj"] == "replicate"
    assert whole["transformer.h.*.mlp.c_fc"] == "colwise"
    # Marked once: the same region is not offered again.
    assert fallback_for(checked, "transformer.h.*.attn", 2, model.transformer.h[0]) is None


def test_code_that_splits_by_heads_keeps_the_head_split() -> None:
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    plan = infer_tp_plan(model)
    assert check_local_shapes(model, plan, 2) is plan


def test_per_head_norms_on_full_width_code_are_refused_with_a_correct_override() -> None:
    model = NanoGPT(qk_norm=True)
    plan = infer_tp_plan(model)
    # Its q/k norms would need the heads split.
    assert fallback_for(plan, "transformer.h.*.attn", 2, model.transformer.h[0]) is None
    with pytest.raises(TPPlanError, match=r"transformer\.h\.0\.attn \(CausalSelfAttention\) fails on the shapes"):
        check_local_shapes(model, plan, 2)


WORLD = 2


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    assert group is not None
    failures = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)
    for parts in (1, 3):
        weight = torch.randn(parts * 8, 8, generator=g)
        grad = torch.randn(2, 5, parts * 8, generator=g)  # the same on every rank, as downstream of a gather
        # This rank's rows: its chunk of every part (a `_StridedShard(0, parts)` layout for parts > 1).
        rows = [torch.cat([w.chunk(WORLD)[r] for w in weight.chunk(parts)]) for r in range(WORLD)]
        outs = [x @ w.t() for w in rows]
        local = outs[rank].clone().requires_grad_()
        full = _GatherColumns.apply(local, group, parts)
        # Each rank's columns put back where the whole projection has them: part p, then rank r within it.
        expected = torch.cat([o.chunk(parts, dim=-1)[p] for p in range(parts) for o in outs], dim=-1)
        if not torch.equal(full, expected) or not torch.allclose(full, x @ weight.t(), rtol=1e-6, atol=1e-6):
            failures.append(f"gather parts={parts}: not the whole projection's output")
        full.backward(grad)
        want = torch.cat([c.chunk(WORLD, dim=-1)[rank] for c in grad.chunk(parts, dim=-1)], dim=-1)
        if not torch.equal(local.grad, want):
            failures.append(f"gather parts={parts}: backward is not this rank's columns of the gradient")
    whole = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    grads = [torch.randn(2, 5, 4, generator=g) for _ in range(WORLD)]  # each rank's gradient of its columns
    taken = _TakeColumns.apply(whole, group)
    if not torch.equal(taken, whole.detach()[..., rank * 4 : (rank + 1) * 4]):
        failures.append("take: not this rank's columns")
    taken.backward(grads[rank])
    if not torch.equal(whole.grad, torch.cat(grads, dim=-1)):
        failures.append("take: backward is not every rank's columns' gradient")
    torch.save(failures, f"{out}.{rank}")
    clean_exit()  # barrier, teardown, os._exit: gloo ranks may abort at interpreter exit (docs/testing.md)


@pytest.mark.slow
def test_gather_and_take_columns_on_two_ranks(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result")
    mp.start_processes(_worker, args=(str(tmp_path / "init"), out), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        assert torch.load(f"{out}.{rank}") == [], f"rank {rank}"
