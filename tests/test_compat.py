"""Private APIs of torch, Lightning, torchmetrics and DeepSpeed: each is where `lightning_par._compat` expects it."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_par import _compat

ROOT = Path(__file__).resolve().parents[1]

# ---- every private API is where _compat expects it -------------------------------------------------------------
@pytest.mark.parametrize("api", _compat.PRIVATE_APIS, ids=lambda api: api.name)
def test_private_api_is_where_compat_expects_it(api: _compat.PrivateAPI) -> None:
    problem = _compat.check(api)
    assert problem is None, problem


def test_a_moved_api_is_reported_with_version_user_and_fix() -> None:
    gone = _compat.PrivateAPI(
        "torch", "torch.nn.Module._gone", "lightning_par.example uses to test", (),
        lambda: _compat._attr("torch.nn.Module._gone"),
    )  # fmt: skip
    message = _compat.check(gone)
    assert message is not None
    version = importlib.metadata.version("torch")
    assert message.startswith(f"torch {version} moved torch.nn.Module._gone, which lightning_par.example")
    assert "update lightning_par/_compat.py" in message and "AttributeError" in message


def test_check_private_apis_finds_nothing_missing() -> None:
    assert _compat.check_private_apis() == []


def test_a_missing_private_name_does_not_break_import_but_fails_on_use() -> None:
    stand_in = _compat._resolve("torch.utils._pytree", "no_such_function")

    class Sub(stand_in):  # a base class that moved still lets the module defining the subclass import
        pass

    assert not isinstance(torch.empty(1), stand_in)
    for make in (stand_in, Sub):
        with pytest.raises(ImportError, match=r"torch\.utils\._pytree\.no_such_function is not in torch .*_compat\.py"):
            make()


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at top level: functions, classes, assignments (both branches of an ``if``)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.If):
            names |= _defined_names(ast.Module(body=node.body + node.orelse, type_ignores=[]))
        elif isinstance(node, ast.ImportFrom) and any(a.asname for a in node.names):
            names.update(a.asname for a in node.names if a.asname)  # `import _x as X` under TYPE_CHECKING
    return names


def test_every_accessor_is_checked() -> None:
    tree = ast.parse((ROOT / "lightning_par" / "_compat.py").read_text())
    own = {"PrivateAPI", "PRIVATE_APIS", "check", "check_private_apis"}
    public = {n for n in _defined_names(tree) if not n.startswith("_")} - own
    checked = {name for api in _compat.PRIVATE_APIS for name in api.accessors}
    assert public <= checked, f"accessors without an entry in PRIVATE_APIS: {sorted(public - checked)}"
    missing = checked - set(vars(_compat))
    assert not missing, f"PRIVATE_APIS names accessors that _compat.py lacks: {sorted(missing)}"


# ---- the hooks torch calls still reach our overrides ------------------------------------------------------------
def test_conversions_go_through_module_apply() -> None:
    # What lightning_par.models.Llama relies on to rebuild its rope table.
    calls = []

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
            calls.append(fn)
            return super()._apply(fn, recurse)

    m = Counted()
    assert m.to(torch.float64) is m and m.lin.weight.dtype == torch.float64
    m.to_empty(device="cpu")
    assert len(calls) == 2, "torch no longer converts through Module._apply: update Llama._apply and _compat.py"


def test_grad_scaler_unscale_reaches_the_hook() -> None:
    seen = []

    class Recording(_compat.GradScalerUnscaleHook):
        def unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[no-untyped-def]
            seen.append(optimizer)
            return super().unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = Recording("cpu", init_scale=4.0)
    scaler.scale((p * 2).sum()).backward()
    scaler.unscale_(opt)
    assert seen == [opt], "GradScaler.unscale_ no longer calls _unscale_grads_: update _compat.py"
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0))


def test_module_internals_and_metric_state_round_trip() -> None:
    from torchmetrics import MeanMetric

    parent = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    parent.register_buffer("scratch", torch.zeros(1), persistent=False)
    _compat.set_child_module(parent, "1", nn.Tanh())
    assert isinstance(parent[1], nn.Tanh) and _compat.non_persistent_buffers(parent) == {"scratch"}
    assert list(_compat.module_parameters(parent[0])) == ["weight", "bias"]
    t = torch.zeros(2)
    before = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == before + 1
    assert _compat.storage_id(t.untyped_storage()) == _compat.storage_id(t[1:].untyped_storage())

    a, b = MeanMetric(), MeanMetric()
    a.update(torch.tensor([1.0, 3.0]))
    _compat.set_metric_state(b, _compat.metric_state(a))
    assert float(b.compute()) == 2.0


def test_compat_imports_only_torch_at_module_level() -> None:
    tree = ast.parse((ROOT / "lightning_par" / "_compat.py").read_text())
    allowed = {"torch", "typing_extensions", "__future__", "dataclasses", "importlib", "inspect", "re", "collections",
               "functools", "typing"}  # fmt: skip
    top = []
    for node in tree.body:  # module level only: TYPE_CHECKING blocks are skipped, accessors import lazily
        if isinstance(node, ast.Import):
            top += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.append(node.module)
    assert {m.split(".")[0] for m in top} <= allowed, f"_compat.py imports {top} at module level"
