"""The probe behind `lightning_par.parallel.tensor.plan`: one tiny forward pass that records who reads whom in block 0
(in the
first block of each structure, when blocks differ).

Hooks on the block's Linears record, for each Linear's input, the nearest block-0 Linear outputs it was computed
from (walking the autograd graph back to the block input). Pairing column- and row-parallel Linears from that
relation is exact where call order alone is not (parallel attention + MLP, adapters on the residual). When the
forward fails, `_registration_order` guesses the same relation from module registration order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclasses.dataclass
class _Trace:
    order: list[str]  # block-relative names (then outer names) in first-call or registration order
    producers: dict[str, set[str]]  # module -> block Linears whose outputs reach its input through non-Linear ops
    in_width: dict[str, int]
    hidden: int
    outer: list[str]  # outer Linears/Embeddings/norms; those before index `marker` run before the trunk
    marker: int
    # block projection -> (op, output shapes) of the first torch call on its output: the split or view that says
    # how a fused projection's output is laid out ([q | k | v] parts, or interleaved per head group)
    consumers: dict[str, tuple[str, list[tuple[int, ...]]]] = dataclasses.field(default_factory=dict)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or ("norm" in type(m).__name__.lower() and not any(m.children()))


def _norm_size(m: nn.Module) -> int:
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() >= 1:
        return int(w.shape[-1])
    shape = getattr(m, "normalized_shape", None)
    return int(shape[-1]) if isinstance(shape, (tuple, list)) and shape else 0


def _walk(node: Any, outs: dict[Any, str], stop: set[Any]) -> set[str]:
    """Linears whose outputs reach `node` without passing another Linear (or the block input)."""
    found: set[str] = set()
    seen: set[Any] = set()
    stack = [node]
    while stack and len(seen) < 100_000:  # a side input with a long history (an encoder output) stops here
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if n in outs:
            found.add(outs[n])
        elif n not in stop:
            stack.extend(f for f, _ in n.next_functions)
    return found


# Python's in-place operators on tensors (``x += y`` calls ``__iadd__``).
_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                            "lshift", "rshift")
) | {"__setitem__"}  # fmt: skip


def writes_in_place(name: str) -> bool:
    """Whether a torch call named ``name`` changes its first argument (``add_``, ``__setitem__``, ``__iadd__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


class _FirstUse(TorchFunctionMode):
    """Records the first torch call on each watched tensor (a block projection's output) and what it returned."""

    _SKIP = frozenset({"size", "dim", "__get__", "numel", "is_contiguous", "contiguous", "__format__"})

    def __init__(self, watched: dict[int, tuple[torch.Tensor, str, dict[str, Any]]]) -> None:
        super().__init__()
        # id -> (tensor kept alive, so ids stay unique; projection name; the consumers of its block's trace)
        self.watched = watched

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        hit = self.watched.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
        name = getattr(func, "__name__", "")
        if hit is not None and hit[1] not in hit[2] and name not in self._SKIP:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            hit[2][hit[1]] = (name, [tuple(t.shape) for t in outs if isinstance(t, torch.Tensor)])
        return out


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode (no dropout, no running statistics updated) for a probe, each put
    back in its own mode afterwards."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


@contextlib.contextmanager
def all_trainable(model: nn.Module) -> Iterator[None]:
    """Every floating-point parameter of ``model`` requiring gradients while a probe traces the autograd graph
    (frozen weights, as under LoRA fine-tuning, would leave their outputs without one), put back afterwards."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


# What a module calls when its class defines no forward: torch's stub, and LightningModule's pass-through to it.
_STUB_FORWARDS = ("Module._forward_unimplemented", "LightningModule.forward")


def _no_forward(module: nn.Module) -> bool:
    return getattr(type(module).forward, "__qualname__", "") in _STUB_FORWARDS


def probe_target(model: nn.Module) -> nn.Module:
    """The module a probe calls: ``model``, or, when it defines no ``forward`` and gives no ``example_input_array``
    (a LightningModule whose ``training_step`` calls the model it wraps: ``self.model(input_ids=x)``), its child
    holding the most parameter tensors, descending until a module has a forward of its own."""
    target = model
    while _no_forward(target) and getattr(target, "example_input_array", None) is None:
        children = list(target.children())
        if not children:
            break
        # Counted by tensors, not elements: no torch call on a parameter (a probe's TorchFunctionMode, active
        # around this call, would take it for a use of the parameter).
        target = max(children, key=lambda c: sum(1 for _ in c.parameters()))
    return target


def probe_call(model: nn.Module) -> None:
    """Call ``model`` once on its ``example_input_array`` (the LightningModule convention: a tensor, a tuple of
    positional arguments or a dict of keyword arguments), or else on a (1, 8) batch of token 0; a model without a
    forward of its own through the module it wraps (`probe_target`)."""
    model = probe_target(model)
    param = next(model.parameters(), None)
    device = param.device if param is not None else None
    example = getattr(model, "example_input_array", None)

    def to(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    if isinstance(example, torch.Tensor):
        model(to(example))
    elif isinstance(example, tuple):
        model(*map(to, example))
    elif isinstance(example, dict):
        model(**{k: to(v) for k, v in example.items()})
    else:
        model(torch.zeros((1, 8), dtype=torch.long, device=device))


def watched_probe(model: nn.Module, watch: Any, handles: list[Any]) -> bool:
    """One `probe_call` in eval mode without gradients under ``watch`` (a torch function mode); ``handles`` (the
    hooks that feed it) are removed after. Returns False when the probe cannot run the model."""
    try:
        with eval_mode(model), torch.no_grad(), watch:
            probe_call(model)
    except Exception:
        return False
    finally:
        for h in handles:
            h.remove()
    return True


def _trace(
    model: nn.Module,
    block: nn.Module,
    inner: dict[str, nn.Module],
    outer: dict[str, nn.Module],
    projections: set[str] | None = None,
) -> _Trace | str:
    """Run the model once on token 0 with hooks on block 0: who reads whom, call order; or why it failed.

    ``projections`` names the modules of ``inner`` and ``outer`` that are projections (Linears or affine leaves,
    `lightning_par.parallel.tensor.plan_affine`); by default the ``nn.Linear`` ones.
    """
    if projections is None:
        projections = {n for n, m in (*inner.items(), *outer.items()) if isinstance(m, nn.Linear)}
    return _trace_blocks(model, [(block, inner, projections)], outer)[0]


def _trace_blocks(
    model: nn.Module,
    blocks: list[tuple[nn.Module, dict[str, nn.Module], set[str]]],
    outer: dict[str, nn.Module],
    wrappers: tuple[dict[str, str], ...] = (),
) -> list[_Trace | str]:
    """`_trace` for several blocks (the first of each structure) in one forward pass: one `_Trace` per block, or
    for all of them why the forward failed. Each entry: (block, its modules by block-relative name, projections
    among them and among ``outer``). ``wrappers``: per block, adapter wrappers (block-relative) -> the projection
    each wraps (peft's ``lora.Linear``: ``base(x) + s B A x``): what the model does with the wrapper's output is
    what it does with the projection's (a fused [gate | up] chunked after the adapter's sum)."""
    traces = [_Trace([], {}, {}, 0, [], -1) for _ in blocks]
    all_outs: list[dict[Any, str]] = []  # per block: grad_fn of a projection's output -> the projection
    outer_order: list[str] = []
    watched: dict[int, tuple[torch.Tensor, str, dict[str, tuple[str, list[tuple[int, ...]]]]]] = {}
    first_use = _FirstUse(watched)
    handles = []
    for k, (tr, (block, inner, projections)) in enumerate(zip(traces, blocks)):
        for wrapper, base in (wrappers[k] if k < len(wrappers) else {}).items():
            see = partial(_see_through, tr, base, watched)
            handles.append(block.get_submodule(wrapper).register_forward_hook(see))
        outs: dict[Any, str] = {}
        stop: set[Any] = set()
        all_outs.append(outs)
        handles.append(block.register_forward_pre_hook(partial(_on_block, tr, outer_order, stop), with_kwargs=True))
        for name, m in inner.items():
            handles += [
                m.register_forward_pre_hook(partial(_pre, tr, name, outs, stop)),
                m.register_forward_hook(partial(_post, tr, name, outs, projections, watched)),
            ]
    handles += [m.register_forward_hook(partial(_post_outer, outer_order, name)) for name, m in outer.items()]
    try:
        # Eval mode: no dropout, so the probe does not draw from the user's RNG streams.
        with eval_mode(model), all_trainable(model), torch.enable_grad(), first_use:
            probe_call(model)
    except Exception as err:
        return [f"{type(err).__name__}: {err}"] * len(blocks)
    finally:
        for h in handles:
            h.remove()
    got: list[_Trace | str] = []
    for tr, outs in zip(traces, all_outs):
        tr.outer = list(outer_order)
        ok = tr.marker >= 0 and bool(outs)
        got.append(tr if ok else "the first block never ran, or no Linear output carried an autograd graph")
    return got


def _on_block(tr: _Trace, outer_order: list[str], stop: set[Any], mod: nn.Module, args: Any, kwargs: Any) -> None:
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tr.marker < 0 and x is not None:
        tr.hidden, tr.marker = int(x.shape[-1]), len(outer_order)
        stop.add(x.grad_fn)


def _pre(tr: _Trace, name: str, outs: dict[Any, str], stop: set[Any], mod: nn.Module, args: tuple[Any, ...]) -> None:
    if name not in tr.producers and args and isinstance(args[0], torch.Tensor):
        tr.producers[name] = _walk(args[0].grad_fn, outs, stop)
        tr.in_width[name] = int(args[0].shape[-1])


def _post(
    tr: _Trace, name: str, outs: dict[Any, str], projections: set[str], watched: dict[int, Any], mod: nn.Module,
    args: tuple[Any, ...], out: Any,
) -> None:  # fmt: skip
    if name not in tr.order:
        tr.order.append(name)
        if name in projections and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            outs[out.grad_fn] = name
            watched[id(out)] = (out, name, tr.consumers)


def _see_through(tr: _Trace, base: str, watched: dict[int, Any], mod: nn.Module, args: Any, out: Any) -> None:
    # The projection's output was first read by its wrapper's sum with the adapter: watch the sum in its place.
    if isinstance(out, torch.Tensor) and tr.consumers.get(base, ("", []))[0] in ("add", "__add__", "add_", "__iadd__"):
        del tr.consumers[base]
        watched[id(out)] = (out, base, tr.consumers)


def _post_outer(order: list[str], name: str, mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    if name not in order:
        order.append(name)


def _registration_order(inner: dict[str, nn.Module], outer: list[str], marker: int, lin: dict[str, Any]) -> _Trace:
    """Guess pairs without a forward pass: per submodule, the last projection back to E reads the earlier ones.

    ``lin``: block projection name -> its widths (``in_features``, ``out_features``), in registration order.
    """
    sizes = [_norm_size(m) for n, m in inner.items() if "." not in n and _is_norm(m)]
    hidden = Counter(sizes or [m.in_features for m in lin.values()] or [0]).most_common(1)[0][0]
    producers: dict[str, set[str]] = {}
    groups: dict[str, list[str]] = {}
    for n in lin:
        groups.setdefault(n.split(".")[0] if "." in n else "", []).append(n)
    for members in groups.values():
        outs = [n for n in members if lin[n].out_features == hidden]
        strict = [n for n in outs if lin[n].in_features != hidden]
        # Two Linears back to E from a wider input both get producers, so the pairing step calls them rivals.
        for o in strict or outs[-1:]:
            producers[o] = {n for n in members[: members.index(o)] if lin[n].in_features == hidden}
    return _Trace(list(inner), producers, {}, hidden, outer, marker)


def block_order(model: nn.Module, blocks: Sequence[nn.Module]) -> list[int] | None:
    """The positions of ``blocks`` in the order one probe forward of ``model`` (`probe_call`, eval mode, no
    gradients) calls them, or ``None`` when that forward fails. A recurrent-depth model (Hugging Face HRM's
    ``L_module`` run six times, some under ``torch.no_grad``) shows a position again."""
    order: list[int] = []
    handles = [b.register_forward_pre_hook(lambda *_, i=i: order.append(i)) for i, b in enumerate(blocks)]
    try:
        with eval_mode(model), torch.no_grad():
            probe_call(model)
    except Exception:
        return None
    finally:
        for h in handles:
            h.remove()
    return order


def out_of_order(order: Sequence[int]) -> str:
    """``""`` when the blocks ran once each, in order; else the order, shown as ``[0, 1, 0, 1]`` for a message (a
    block run again, a recurrent-depth loop, or out of order: what neither a pipeline nor context parallelism
    can lay out)."""
    if all(a < b for a, b in itertools.pairwise(order)):
        return ""
    return "[" + ", ".join(map(str, order[:12])) + (", ...]" if len(order) > 12 else "]")


@contextlib.contextmanager
def running_modules(model: nn.Module) -> Iterator[list[str]]:
    """The names of ``model``'s modules whose forward is in progress, innermost last: after an exception inside
    the ``with``, the last one is where it was raised (the hooks come off on leaving)."""
    stack: list[str] = []

    def leave(*_: Any) -> None:
        stack.pop()

    handles = []
    for name, mod in model.named_modules():
        handles += [mod.register_forward_pre_hook(lambda *_, n=name: stack.append(n)), mod.register_forward_hook(leave)]
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()
