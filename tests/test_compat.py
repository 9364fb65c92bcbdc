"""Private APIs of torch, Lightning, torchmetrics and DeepSpeed: each is where `lightning_par._compat` expects it,
and no other module reaches one directly (so an upgrade that moves one means editing `_compat/` alone)."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import _private_apis
import pytest
import torch
from torch import nn

from lightning_par import _compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "lightning_par" / "_compat"  # the accessors: __init__.py and lightning.py
LIBRARIES = frozenset({"torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "deepspeed"})

# Private (or undocumented) names of those libraries that lightning_par uses: an attribute, a getattr string or a
# method override with one of these names outside `_compat/` is a use that bypasses it. Private attributes are
# also caught when read off a name imported from the libraries (`torch._x`, `dist._x`, `DTensor._x`).
# Not here, deliberately: Lightning's private hooks overridden in classes, DeepSpeedStrategy._setup_model_and_optimizer
# (benchmarks/bench_deepspeed.py) and Strategy._configure_launcher (strategies/parallel.py): a Lightning base class
# cannot live in `_compat/`, which imports no Lightning at module level. PRIVATE_APIS checks that both still exist.
KNOWN_PRIVATE = frozenset({
    # torch
    "_StridedShard", "_flatten", "_spec", "_local_tensor", "_version", "_cdata", "_schema", "_c10d_functional",
    "_modules", "_parameters", "_non_persistent_buffers_set", "_amp_foreach_non_finite_check_and_unscale_",
    "_unscale_grads_", "_apply", "_prepare_input_fn", "_slice_file", "_init_optim_state", "_wait_batch_p2p",
    "_step_microbatches", "pipeline_order", "_pytree", "_python_dispatch", "_MEM_FORMAT_ENCODING", "_StorageInfo",
    "_get_layout", "StorageWeakRef", "_get_default_store", "_get_sequence_number_for_group", "_module_fqn",
    "_dump_fr_trace", "_dump_nccl_trace",
    # Lightning
    "_AcceleratorConnector", "_check_and_init_precision", "_precision_plugin_flag", "_accelerator_flag",
    "_precision_flag", "_Stateful", "_combined_loader", "_trainer", "_optimizer", "_init_dist_connection",
    "_get_default_process_group_backend_for_device", "_distributed_is_initialized", "_sync_ddp_if_available",
    "_SubprocessScriptLauncher", "_launcher", "_reset_optimizers_and_schedulers", "_init_deepspeed_distributed",
    "_last_global_step_saved",
    # torchmetrics
    "_defaults", "_update_count", "_forward_cache", "_computed",
    # DeepSpeed (public names of undocumented internals)
    "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
    "sub_group_to_group_id", "swap_optimizer", "ds_shape", "_lazy_init_hp_params_optimizer_state",
    "_hp_optimizer_states_linked",
})  # fmt: skip


# Uses that cannot go through `_compat` (path, what): models/ stands for user code and imports nothing from
# lightning_par (tests/test_models.py); PRIVATE_APIS still checks the API.
ALLOWED = frozenset({
    ("lightning_par/models/llama.py", "overrides Llama._apply"),
    ("lightning_par/models/llama.py", "._apply"),  # its super()._apply(fn, recurse)
})  # fmt: skip


# ---- every private API is where _compat expects it -------------------------------------------------------------
@pytest.mark.parametrize("api", _private_apis.PRIVATE_APIS, ids=lambda api: api.name)
def test_private_api_is_where_compat_expects_it(api: _private_apis.PrivateAPI) -> None:
    problem = _private_apis.check(api)
    assert problem is None, problem


def test_a_moved_api_is_reported_with_version_user_and_fix() -> None:
    gone = _private_apis.PrivateAPI(
        "torch", "torch.nn.Module._gone", "lightning_par.example uses to test", (),
        lambda: _compat._attr("torch.nn.Module._gone"),
    )  # fmt: skip
    message = _private_apis.check(gone)
    assert message is not None
    version = importlib.metadata.version("torch")
    assert message.startswith(f"torch {version} moved torch.nn.Module._gone, which lightning_par.example")
    assert "update lightning_par/_compat" in message and "AttributeError" in message


def test_check_private_apis_finds_nothing_missing() -> None:
    assert _private_apis.check_private_apis() == []


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
    own = {"PrivateAPI", "PRIVATE_APIS", "check", "check_private_apis"}
    public = set().union(*(_defined_names(ast.parse(f.read_text())) for f in COMPAT.glob("*.py")))
    public = {n for n in public if not n.startswith("_")} - own
    checked = {name for api in _private_apis.PRIVATE_APIS for name in api.accessors}
    assert public <= checked, f"accessors without an entry in PRIVATE_APIS: {sorted(public - checked)}"
    missing = checked - set(vars(_compat))
    assert not missing, f"PRIVATE_APIS names accessors that _compat does not export: {sorted(missing)}"


# ---- the hooks torch calls still reach our overrides ------------------------------------------------------------
def test_conversions_go_through_module_apply() -> None:
    # What lightning_par.models.Llama relies on to rebuild its rope table (see ALLOWED).
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
    assert len(calls) == 2, "torch no longer converts through Module._apply: update Llama._apply and _compat"


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
    assert seen == [opt], "GradScaler.unscale_ no longer calls _unscale_grads_: update _compat"
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


# ---- nothing else reaches them --------------------------------------------------------------------------------
def _library_names(tree: ast.Module) -> set[str]:
    """Local names bound by imports from the libraries (``torch``, ``dist``, ``nn``, ``DTensor``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` reaches a private name of the libraries without `_compat`: ``(line, what)``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = _library_names(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            private = [a.name for a in node.names if _is_private(a.name) or a.name in KNOWN_PRIVATE]
            if private or any(_is_private(part) for part in node.module.split(".")):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            private = [a.name for a in node.names if a.name.split(".")[0] in LIBRARIES and any(
                _is_private(part) for part in a.name.split("."))]  # fmt: skip
            what = f"import {', '.join(private)}" if private else None
        elif isinstance(node, ast.Attribute):
            base = _root(node)
            if isinstance(node.value, ast.Name) and node.value.id == "_compat":
                pass  # the accessors themselves (`_compat.pipeline_order`)
            elif node.attr in KNOWN_PRIVATE:
                what = f".{node.attr}"
            elif isinstance(base, ast.Name) and base.id in bound and _is_private(node.attr):
                what = f"{base.id}. ... .{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "getattr", "hasattr", "setattr", "delattr"
        ):  # fmt: skip
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in KNOWN_PRIVATE:
                what = f"{node.func.id}(..., {node.args[1].value!r})"
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in KNOWN_PRIVATE:
                    found.append((item.lineno, f"overrides {node.name}.{item.name}"))
        if what is not None:
            found.append((node.lineno, what))
    return sorted(found)


def _scanned() -> list[Path]:
    files = [*sorted((ROOT / "lightning_par").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    return [f for f in files if COMPAT not in f.parents]


def test_no_module_but_compat_reaches_private_apis() -> None:
    offenders = {}
    for f in _scanned():
        name = f.relative_to(ROOT).as_posix()
        if uses := [f"{line}: {what}" for line, what in private_uses(f) if (name, what) not in ALLOWED]:
            offenders[name] = uses
    assert not offenders, (
        "these reach private torch/Lightning/torchmetrics/DeepSpeed names directly; add an accessor to "
        f"lightning_par/_compat/ (with a PRIVATE_APIS entry) and use it instead: {offenders}"
    )


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    source = tmp_path / "bad.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_map\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "x = torch._foo\ny = mesh._flatten('dp')\nz = getattr(opt, 'swap_optimizer', False)\nw = dist.c10d._bar\n"
        "class S(torch.amp.GradScaler):\n    def _unscale_grads_(self): ...\n"
    )
    lines = [line for line, _ in private_uses(source)]
    assert lines == [3, 4, 5, 6, 7, 8, 10], private_uses(source)


def test_compat_imports_only_torch_at_module_level() -> None:
    allowed = {"torch", "typing_extensions", "__future__", "contextlib", "dataclasses", "importlib", "inspect", "re",
               "collections",
               "functools", "typing"}  # fmt: skip
    top = []
    body = [node for f in COMPAT.glob("*.py") for node in ast.parse(f.read_text()).body]
    for node in body:  # module level only: TYPE_CHECKING blocks are skipped, accessors import lazily
        if isinstance(node, ast.Import):
            top += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lightning_par._compat"):
            top.append(node.module)
    assert {m.split(".")[0] for m in top} <= allowed, f"_compat imports {top} at module level"
