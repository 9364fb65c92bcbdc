"""Host syncs per MoE layer: the points where a CUDA step would wait for the device, counted on CPU.

On CUDA the host waits for the device whenever it reads device data: ``.tolist()``, ``.item()`` / ``int()`` /
``bool()`` of a tensor, and every op whose output size depends on the values (``nonzero``, ``bincount``,
``repeat_interleave`` without ``output_size``, boolean masking, ``unique``). `_Syncs` counts those in one MoE
layer's forward and backward (a TorchDispatchMode, plus a counting ``Tensor.tolist``, which bypasses the
dispatcher), so a sync added to the path fails here. What remains, per layer: one under expert parallelism (the
dispatch reads the exchanged counts: ``all_to_all_single`` takes uneven split sizes on the host), one on a single
device (the experts' split sizes); capacity adds two (N for the capacity, ``nonzero`` of the kept mask).
Host -> device copies are not visible on CPU; the code makes them asynchronous (``non_blocking=True``).

The exchange runs over a 1-rank gloo group in this process: the same code path as ep > 1, with every row staying.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_par.nn import MoE
from lightning_par.parallel.experts.dispatch import ExpertDispatch
from lightning_par.parallel.experts.module_list import shard_module_list_experts
from lightning_par.parallel.experts.stacked import shard_stacked_experts
from lightning_par.parallel.experts.with_tp import TokenSplit

aten = torch.ops.aten
_ALWAYS = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t)
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


class _Syncs(TorchDispatchMode):
    """Names of the ops (and ``tolist`` calls) that read device data on the host, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.found: list[str] = []
        tolist = torch.Tensor.tolist

        def counted(t: Tensor) -> Any:
            self.found.append("tolist")
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        masked = func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in _ALWAYS or sized or masked:
            self.found.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


def _forward_backward(module: nn.Module, x: Tensor, syncs: _Syncs) -> Tensor:
    x = x.clone().requires_grad_(True)
    with syncs:
        y = module(x)
        y.square().sum().backward()
    return y.detach()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def _moe(capacity: float | None = None) -> MoE:
    torch.manual_seed(0)
    return MoE(8, 16, 4, top_k=2, capacity_factor=capacity, activation="silu", gated=True)


def test_one_device_layer(monkeypatch):
    syncs = _Syncs(monkeypatch)
    _forward_backward(_moe(), torch.randn(2, 5, 8), syncs)
    assert syncs.found == ["tolist"]  # the experts' split sizes
    syncs.found.clear()
    _forward_backward(_moe(capacity=1.0), torch.randn(2, 5, 8), syncs)
    assert syncs.found == ["_local_scalar_dense", "nonzero", "tolist"]  # + N for capacity, the kept rows


@pytest.mark.parametrize("token_split", [False, True])
def test_expert_parallel_layer(group, monkeypatch, token_split):
    moe, ref = _moe(), _moe()
    hooks = ExpertDispatch(group, 1, 4, TokenSplit(group) if token_split else None)
    moe.experts.register_forward_pre_hook(hooks.dispatch)
    moe.experts.register_forward_hook(hooks.combine)
    syncs = _Syncs(monkeypatch)
    x = torch.randn(2, 5, 8)
    y = _forward_backward(moe, x, syncs)
    assert syncs.found == ["tolist"]  # the dispatch's one copy of the exchanged counts
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)


class _ListMoE(nn.Module):
    """A user's MoE over an ``nn.ModuleList`` (its own loop has one ``nonzero`` per expert)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, 8)
        weights, chosen = self.router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class _StackedExperts(nn.Module):
    """Stacked experts called as ``experts(hidden, top_k_index, top_k_weights)`` (the Hugging Face 5 layout)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Parameter(torch.randn(4, 8, 12) * 0.3)
        self.down = nn.Parameter(torch.randn(4, 12, 8) * 0.3)

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        for e in range(len(self.up)):
            token, slot = torch.where(index == e)
            h = torch.relu(hidden[token] @ self.up[e]) @ self.down[e]
            out.index_add_(0, token, h * weights[token, slot, None])
        return out


def test_module_list_and_stacked_adapters_add_one(group, monkeypatch):
    syncs = _Syncs(monkeypatch)
    x = torch.randn(2, 5, 8)
    ref = _ListMoE()
    want = _forward_backward(ref, x, syncs)
    own = len(syncs.found)  # the user's block: its nonzero per expert
    syncs.found.clear()
    block = _ListMoE()
    shard_module_list_experts(block, block.experts, ExpertDispatch(group, 1, 4), 0, 4, "experts")
    got = _forward_backward(block, x, syncs)
    assert len(syncs.found) == 2 * own + 1  # record and replay run the user's block; + the dispatch's one copy
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    stacked, ref_stacked = _StackedExperts(), _StackedExperts()
    torch.manual_seed(1)
    hidden, index = torch.randn(10, 8), torch.randint(0, 4, (10, 2))
    weights = torch.rand(10, 2)
    syncs.found.clear()
    with syncs:
        want = ref_stacked(hidden, index, weights)
    own = len(syncs.found)
    shard_stacked_experts(stacked, ExpertDispatch(group, 1, 4), 4, "experts")
    syncs.found.clear()
    with syncs:
        got = stacked(hidden, index, weights)
        got.sum().backward()
    assert len(syncs.found) == own + 1  # the model's own expert loop, once, + the dispatch's one copy
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
