"""The name-keyed state dicts a save starts from (checkpoint/fast_state.py): equal to torch's `get_*_state_dict`,
replayed from a renaming after the first call, and torch's own functions wherever the renaming was not verified."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_par.checkpoint import fast_state
from lightning_par.models import GPT


def _trained() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16))
    model._loss(model(x), x).backward()
    opt.step()
    return model, opt


def _assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert list(got) == list(ref)
    for k, v in ref.items():
        assert fast_state._same(got[k], v), k


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def fail(*_: Any, **__: Any) -> Any:
        raise AssertionError(f"{name} called again: the verified renaming should have been replayed")

    monkeypatch.setattr(fast_state, name, fail)


def test_model_state_is_torchs_and_replayed_after_the_first_call(monkeypatch):
    model, _ = _trained()
    ref = get_model_state_dict(model)
    _assert_same(fast_state.model_state_dict(model), ref)  # first call: torch's, and the renaming is checked
    _forbid(monkeypatch, "get_model_state_dict")
    replayed = fast_state.model_state_dict(model)
    _assert_same(replayed, ref)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # the live tensors, not copies
    assert torch.equal(replayed["lm_head.weight"], model.lm_head.weight)


def test_model_state_follows_a_changed_module(monkeypatch):
    model, _ = _trained()
    fast_state.model_state_dict(model)
    model.register_buffer("extra", torch.ones(3))  # new keys: worked out again, with torch's function
    calls = []
    monkeypatch.setattr(fast_state, "get_model_state_dict", lambda m: calls.append(1) or get_model_state_dict(m))
    assert "extra" in fast_state.model_state_dict(model) and calls == [1]


def test_optimizer_state_is_torchs_and_replayed_with_live_param_groups(monkeypatch):
    model, opt = _trained()
    ref = dict(get_optimizer_state_dict(model, opt))
    first = fast_state.optimizer_state_dict(model, opt)
    assert first["param_groups"] == ref["param_groups"] and first["state"].keys() == ref["state"].keys()
    _forbid(monkeypatch, "get_optimizer_state_dict")
    opt.param_groups[0]["lr"] = 5e-4  # what an LR scheduler does between saves
    replayed = fast_state.optimizer_state_dict(model, opt)
    assert replayed["param_groups"][0]["lr"] == 5e-4
    assert replayed["param_groups"][0]["params"] == ref["param_groups"][0]["params"]  # parameter names
    for name, state in ref["state"].items():
        _assert_same(replayed["state"][name], state)


def test_unverifiable_renaming_falls_back_to_torch_on_every_call(monkeypatch):
    model, opt = _trained()
    # torch's functions stand in for a layout a plain renaming cannot reproduce (other names, here).
    odd = lambda m: {f"odd.{k}": v for k, v in get_model_state_dict(m).items()}  # noqa: E731
    calls = []
    monkeypatch.setattr(fast_state, "get_model_state_dict", lambda m: calls.append(1) or odd(m))
    for _ in range(3):
        assert all(k.startswith("odd.") for k in fast_state.model_state_dict(model))
    assert calls == [1, 1, 1]
    odd_opt = lambda m, o: {**get_optimizer_state_dict(m, o), "param_groups": []}  # noqa: E731
    opt_calls = []
    monkeypatch.setattr(fast_state, "get_optimizer_state_dict", lambda m, o: opt_calls.append(1) or odd_opt(m, o))
    for _ in range(3):
        assert fast_state.optimizer_state_dict(model, opt)["param_groups"] == []
    assert opt_calls == [1, 1, 1]
