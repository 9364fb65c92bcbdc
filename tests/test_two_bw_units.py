"""PipeDream-2BW's pieces without process groups: weight versions and the schedule's replayed bubble.

- `WeightVersion`: a step's forward runs on leaves that alias the parameters (no copy: same storage); after
  `freeze` (the one copy) the optimizer may overwrite the parameters in place and the backward still computes the
  gradients of the weights the forward saw: exactly (bitwise) those of a copy of the model kept at the old
  weights, for input and weight gradients, with a block under activation checkpointing (non-reentrant and
  reentrant: the recomputation must run on the old weights too). The gradients collect on the version, never on
  the parameters. Checked to fail: the same backward without `freeze` (the parameters' new values) is far off.
- The schedule's table (`two_bw_order`) replayed with F = 1, B = 2: the steady-state step idles
  (p - 1) / (3 m + p - 1) for p <= 4 (only the forward ramp of the step boundary), below 1F1B's (p - 1) / (m + p - 1).
- Config refusals naming the fix.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.analysis.pipeline_timeline import one_f_one_b_order, replay, two_bw_order
from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.parallel.pipeline.two_bw import WeightVersion


class _Block(nn.Module):
    def __init__(self, ckpt: str | None) -> None:
        super().__init__()
        self.up, self.down, self.ckpt = nn.Linear(8, 16), nn.Linear(16, 8), ckpt

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt is None:
            return x + self._inner(x)
        return x + checkpoint(self._inner, x, use_reentrant=self.ckpt == "reentrant")


def _holders(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if p is not None]


@pytest.mark.parametrize("ckpt", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("freeze", [True, False])
def test_backward_after_the_update_uses_the_weights_the_forward_saw(ckpt: str | None, freeze: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(ckpt), nn.LayerNorm(8), _Block(ckpt))
    old = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    version = WeightVersion(_holders(model))
    assert all(
        leaf.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        for leaf, p in zip(version.leaves, version.params, strict=True)
    )  # fmt: skip  (the current version: no copy)
    with version.swapped():
        y = model(x)
    if freeze:
        version.freeze()
    with torch.no_grad():  # the optimizer's step: in place, on the parameters
        for p in model.parameters():
            p.add_(0.5)
    with version.swapped():
        y.pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # the gradient is the version's, not the parameters'

    x_ref = x.detach().clone().requires_grad_(True)
    old(x_ref).pow(2).sum().backward()
    same = torch.equal(x.grad, x_ref.grad) and all(
        g is not None and torch.equal(g, p.grad) for g, p in zip(version.gradients(), old.parameters(), strict=True)
    )
    assert same == freeze  # without the copy the backward reads the updated weights: checked to fail


def test_freeze_copies_once_and_only_the_versions_weights() -> None:
    model = nn.Linear(4, 4)
    version = WeightVersion(_holders(model))
    version.freeze()
    frozen = version.frozen
    version.freeze()
    assert version.frozen is frozen and frozen is not None
    assert sum(t.numel() for t in frozen) == sum(p.numel() for p in model.parameters())
    assert all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for t, p in zip(frozen, model.parameters(), strict=True))  # fmt: skip


def test_swapped_restores_the_parameters_even_on_error() -> None:
    model = nn.Linear(4, 4)
    version = WeightVersion(_holders(model))
    with pytest.raises(RuntimeError), version.swapped():
        assert model.weight is version.leaves[0]
        raise RuntimeError("user code failed")
    assert isinstance(model.weight, nn.Parameter) and model.weight is version.params[0]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_two_bw_idles_only_the_forward_ramp(p: int, k: int) -> None:
    m = k * p
    order, given = two_bw_order(p, m)
    step = replay(order, 1.0, 1.0, 1.0, given=given)  # a full backward costs b + w = 2
    assert step.bubble == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12)
    assert step.bubble < replay(one_f_one_b_order(p, m), 1.0, 1.0, 1.0).bubble
    # Every stage runs each of the step's forwards once and m backwards, p - 1 - s of them the previous step's.
    for s, acts in order.items():
        forwards = [a.microbatch_index for a in acts if a.computation_type == "F"]
        backwards = [a.microbatch_index for a in acts if a.computation_type == "B"]
        assert forwards == list(range(m, 2 * m)) and backwards == list(range(m - (p - 1 - s), 2 * m - (p - 1 - s)))


def test_two_bw_table_needs_what_the_previous_step_left() -> None:
    order, given = two_bw_order(4, 4)
    with pytest.raises(ValueError, match="cannot progress"):
        replay(order, 1.0, 1.0, 1.0)  # without the previous step's outputs the first backwards never start
    assert replay(order, 1.0, 1.0, 1.0, given=given).makespan > 0


_REFUSED = {
    "tp": {"tp": 2},
    "zero3": {"zero_stage": 3},
    "zero2": {"zero_stage": 2},
    "compile": {"compile": True},
    "fp8": {"fp8": "emulate"},
    "powersgd": {"grad_compression": "powersgd"},
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_two_bw_refuses_what_it_cannot_swap(name: str) -> None:
    make = functools.partial(ParallelConfig, pp=2, pp_schedule="2bw")
    fix = r"pp_schedule='2bw' with .*'pipe_zero1'\), or use pp_schedule='1f1b'"
    with pytest.raises(ParallelConfigError, match=fix):
        make(**_REFUSED[name])
    make(zero_stage=1, dp_shard=2)  # data parallelism with ZeRO-1 beside it is fine


def test_two_bw_needs_a_pipeline() -> None:
    with pytest.raises(ParallelConfigError, match="set pp >= 2"):
        ParallelConfig(pp_schedule="2bw")
