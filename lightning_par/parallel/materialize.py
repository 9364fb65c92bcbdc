"""Models built on the meta device: each rank creates only the tensors it holds, and initialises them the same way
on every layout.

A model built in ``configure_model()`` or under ``trainer.init_module(empty_init=True)`` has meta parameters: shapes,
no storage. `parallelize` cuts, slices and shards that empty model as it would a real one, then calls `materialize`:
every meta tensor this rank still holds gets storage on the device (its shard, its slice, its stage's modules only),
and its values come from the model's own initialisation, run on one *unit* at a time at full size:

- the units are the trunk's blocks, the subtrees outside the trunk (embeddings, final norm, head) and, as a unit
  of their own direct tensors only, the modules that contain the trunk;
- a unit is initialised on a full-size copy taken before anything was cut (`capture_init`), with the random
  generator seeded from the job's seed and the unit's name, so a unit's values do not depend on which ranks hold
  it, how it is split, or what else was initialised before it: the weights after set-up are the same on every
  layout and world size, one process included;
- each tensor of the copy goes into this rank's layout of it (`lightning_par.checkpoint.place`), and the copy is
  dropped. The transient is one unit's full weights (the largest block, or the embedding).

Which initialisation runs, for each module of the unit, children before parents (as ``nn.Module.apply`` and
Hugging Face's ``initialize_weights`` order them): ``reset_parameters()`` when the module has one (torch's
layers), then the nearest Hugging Face ``PreTrainedModel``'s ``_init_weights(module)`` (which also recomputes the
rotary tables), then the module's own ``init_weights()`` when it takes no argument; a peft LoRA layer then gets
peft's own initialisation of its adapters (``reset_lora_parameters``, as ``init_lora_weights`` says: B zero, so the
adapted model starts as its base). A tensor that none of them wrote is refused with its name, before training
(`UninitializedError`): its values would be whatever memory held.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.blocks.trunk import Trunk
from lightning_par.checkpoint.adapters import peft_models
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.place import place_full


class UninitializedError(ValueError):
    """A tensor of a meta-built model that no initialisation of its module writes."""


def has_meta(module: nn.Module) -> bool:
    """Whether any registered parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from (b for b in module.buffers() if b is not None)


@dataclasses.dataclass
class _Unit:
    name: str  # qualified name in the user's module ("" for the root)
    template: nn.Module  # a meta copy taken before any transform (full shapes)
    shallow: bool  # only the module's direct tensors (a module that contains the trunk)
    hf_roots: dict[str, Any]  # relative module name -> nearest Hugging Face PreTrainedModel (the original)
    # relative name of a peft LoRA layer -> its adapters' init_lora_weights (`_lora_inits`)
    lora: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class InitTemplates:
    """What `materialize` needs from the model as it was built: full-size meta copies of every unit, and which
    name of a shared (tied) tensor decides its value.

    Args:
        units: the units, by qualified name.
        owner: for every tensor name, the name whose module initialises it (itself unless tied).
        meta_names: the names of the tensors that were on the meta device (only those are initialised).
    """

    units: dict[str, _Unit]
    owner: dict[str, str]
    meta_names: frozenset[str]

    def unit_of(self, name: str) -> tuple[_Unit, str]:
        """The unit holding tensor ``name`` and the tensor's name inside it."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            unit = self.units.get(".".join(parts[:cut]))
            if unit is not None and (not unit.shallow or cut == len(parts) - 1):
                return unit, ".".join(parts[cut:])
        raise KeyError(name)


def _hf_roots(module: nn.Module) -> dict[str, Any]:
    """For every module name, the nearest Hugging Face ``PreTrainedModel`` at or above it (``None`` outside one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional
        return {}
    roots: dict[str, Any] = {}
    for name, m in module.named_modules():
        parent = roots.get(name.rpartition(".")[0]) if name else None
        roots[name] = m if isinstance(m, PreTrainedModel) else parent
    return roots


def _shallow_copy(module: nn.Module) -> nn.Module:
    # A meta copy whose direct tensors `init_unit` allocates; its children stay meta (no storage), so that an
    # initialisation reading or touching them (litgpt's rope cache reads the config) runs, writing nothing. The
    # Trainer a LightningModule references is shared, not copied.
    trainer = _compat.attached_trainer(module)
    return copy.deepcopy(module, {id(trainer): trainer} if trainer is not None else None)


def _post_order(m: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    # The order of nn.Module.apply and Hugging Face's initialize_weights: children (in order) before parents.
    for name, child in m.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, m


def _direct(m: nn.Module) -> list[Tensor]:
    return [t for _, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]


def _units(module: nn.Module, trunk: Optional[Trunk]) -> dict[str, _Unit]:
    roots = _hf_roots(module)
    path = trunk.path if trunk is not None else None
    blocks = set(trunk.names) if trunk is not None else set()
    above = {""} if path is None else {".".join(path.split(".")[:i]) for i in range(len(path.split(".")) + 1)}
    units: dict[str, _Unit] = {}
    whole: list[str] = []  # units copied with their subtree: nothing below them is a unit of its own

    def rel_roots(name: str, m: nn.Module) -> dict[str, Any]:
        return {rel: roots.get(f"{name}.{rel}" if name and rel else name or rel) for rel, _ in m.named_modules()}

    for name, m in module.named_modules():
        if any(name.startswith(u + ".") for u in whole):
            continue
        if name in above or name == path:  # contains the trunk (or is its container): its own tensors only
            if _direct(m):
                units[name] = _Unit(name, _shallow_copy(m), True, {"": roots.get(name)})
            continue
        if name in blocks or any(True for _ in _tensors(m)):
            units[name] = _Unit(name, copy.deepcopy(m), False, rel_roots(name, m))
            whole.append(name)
    return units


def capture_init(module: nn.Module, trunk: Optional[Trunk]) -> InitTemplates:
    """Take what `materialize` needs, before the model is cut, sliced or sharded (cheap: meta copies)."""
    last: dict[int, str] = {}
    named = [(clean_name(n), t) for n, t in module.named_parameters(remove_duplicate=False)]
    for name, p in named:
        last[id(p)] = name  # the last module holding a shared tensor initialises it (the order of nn.Module.apply)
    owner = {name: last[id(p)] for name, p in named}
    buffers = [(clean_name(n), b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    meta = frozenset(n for n, t in (*named, *buffers) if t.is_meta)
    units = _units(module, trunk)
    for name, inits in _lora_inits(module).items():
        unit = next((u for u in units.values() if not u.shallow and (not u.name or name.startswith(f"{u.name}."))),
                    None)  # fmt: skip
        if unit is not None:
            unit.lora[name[len(unit.name) + 1 :] if unit.name else name] = inits
    return InitTemplates(units, owner, meta)


def _lora_inits(module: nn.Module) -> dict[str, dict[str, Any]]:
    """peft's LoRA layers built on the meta device -> each adapter's ``init_lora_weights`` (from the enclosing
    PEFT model's config): peft initialises them in ``update_layer``, which wrote nothing on the meta device.

    Raises:
        UninitializedError: an initialisation that reads the base weights (DoRA's magnitude, PiSSA, OLoRA, LoftQ,
            EVA, ...): they have no values yet on the meta device.
    """
    found: dict[str, dict[str, Any]] = {}
    for path, peft, configs in peft_models(module):
        for rel, layer in peft.named_modules():
            if not callable(getattr(layer, "reset_lora_parameters", None)) or not any(t.is_meta for t in
                                                                                      _tensors(layer)):  # fmt: skip
                continue
            name = clean_name(f"{path}.{rel}" if path else rel)
            inits = {a: getattr(configs.get(a), "init_lora_weights", True) for a in getattr(layer, "lora_A", {})}
            dora = [a for a in inits if getattr(configs.get(a), "use_dora", False)]
            odd = [a for a, i in inits.items() if i not in (True, False, "gaussian")]
            if dora or odd:
                what = "use_dora" if dora else f"init_lora_weights={inits[odd[0]]!r}"
                raise UninitializedError(
                    f"{name}: peft's {what} initialises the adapter from the base layer's weights, which a model "
                    "built on the meta device does not have yet; build the adapted model on a real device (outside "
                    "configure_model() / init_module(empty_init=True)), or use init_lora_weights=True"
                )
            found[name] = inits
    return found


class _Writes(TorchFunctionMode):
    """Records the storages that in-place tensor methods write (what an initialisation touched): ``normal_``,
    ``uniform_``, ``zero_``, ``copy_``, ``t[i] = v``, on the tensor or a view of it; torch.nn.init and transformers'
    initialisation call these."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # The written tensor: the method's self, or torch.nn.init's first argument (passed as ``tensor=``).
        target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if isinstance(target, Tensor) and (name == "__setitem__" or _in_place(name)):
            self.written.add(target.untyped_storage().data_ptr())
        if isinstance(kwargs.get("out"), Tensor):
            self.written.add(kwargs["out"].untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _init_module(m: nn.Module, hf: Any) -> None:
    # torch's layers define reset_parameters(); nn.MultiheadAttention and nn.Transformer the private
    # _reset_parameters() (what their __init__ calls).
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
    if hf is not None:
        hf._init_weights(m)
    own = getattr(type(m), "init_weights", None)
    if callable(own) and hf is None:
        try:
            m.init_weights()  # type: ignore[operator]
        except TypeError:
            pass  # an init_weights that needs arguments is the user's to call; other modules' rules still apply


def _init_lora(layer: Any, adapter: str, how: Any) -> None:
    # After its children's rules (the model's own init reached lora_A / lora_B as any Linear): what peft's
    # update_layer does when built eagerly. True / "gaussian": its reset_lora_parameters (B zero, so the adapted model
    # starts as the base); False: the Linear's own initialisation, which peft keeps.
    if how is False:
        for pair in (layer.lora_A, layer.lora_B):
            pair[adapter].reset_parameters()
    else:
        layer.reset_lora_parameters(adapter, how)


def unit_seed(base: int, name: str) -> int:
    """The seed of a unit: the job's seed mixed with the unit's name (stable across runs and Python versions)."""
    return (base * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_unit(unit: _Unit, device: torch.device, base_seed: int) -> dict[str, Tensor]:
    """The unit's tensors at full size, initialised by the model's own rules, by name inside the unit.

    Raises:
        UninitializedError: a tensor that no rule wrote.
    """
    twin = _shallow_copy(unit.template) if unit.shallow else copy.deepcopy(unit.template)
    if unit.shallow:
        for k, v in [*twin.named_parameters(recurse=False), *twin.named_buffers(recurse=False)]:
            setattr(twin, k, _empty(v, device))  # a registered name: stays a parameter / (non-)persistent buffer
    else:
        twin.to_empty(device=device)
    before = {n: (t, t.untyped_storage().data_ptr()) for n, t in _state(twin, unit.shallow)}
    devices = [device] if device.type == "cuda" else []
    writes = _Writes()
    with torch.random.fork_rng(devices=devices), writes:
        torch.manual_seed(unit_seed(base_seed, unit.name))
        for rel, m in _post_order(twin) if not unit.shallow else [("", twin)]:
            _init_module(m, unit.hf_roots.get(rel))
            for adapter, how in unit.lora.get(rel, {}).items():
                _init_lora(m, adapter, how)
    after = dict(_state(twin, unit.shallow))
    missing = [n for n, t in after.items() if _untouched(t, before.get(n), writes.written)]
    if missing:
        where = ".".join(p for p in (unit.name, missing[0]) if p)
        owner = twin.get_submodule(missing[0].rpartition(".")[0]) if "." in missing[0] else twin
        raise UninitializedError(
            f"{where} ({type(owner).__name__}) was built on the meta device and nothing initialises it: neither "
            f"{type(owner).__name__}.reset_parameters(), a Hugging Face _init_weights, nor an init_weights() writes "
            f"it ({len(missing)} such tensor(s) in {unit.name or 'the root'}). Define reset_parameters() on "
            f"{type(owner).__name__} that fills its parameters and recomputes its buffers, or build the model "
            "outside configure_model() / init_module(empty_init=True)"
        )
    return after


def _untouched(t: Tensor, before: Optional[tuple[Tensor, int]], written: set[int]) -> bool:
    # Written in place, re-assigned (``self.weight = nn.Parameter(...)``) or given new storage (``.data = ...``).
    ptr = t.untyped_storage().data_ptr()
    return before is not None and before[0] is t and before[1] == ptr and ptr not in written


def _empty(t: Tensor, device: torch.device) -> Tensor:
    empty = torch.empty_like(t, device=device)
    return nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _state(m: nn.Module, direct: bool = False) -> Iterator[tuple[str, Tensor]]:
    for n, t in m.named_parameters(remove_duplicate=False, recurse=not direct):
        yield n, t
    for n, b in m.named_buffers(remove_duplicate=False, recurse=not direct):
        if b is not None:
            yield n, b


def base_seed() -> int:
    """The job's seed, equal on every rank (rank 0's ``torch.initial_seed()``: ``seed_everything`` sets it)."""
    seed = [torch.initial_seed()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def allocate(module: nn.Module, device: torch.device) -> None:
    """Give every meta tensor of ``module`` empty storage on ``device`` and move the others there (in place).

    Parameters keep their identity (their contents are swapped, not replaced): expert parallelism, tied pipeline
    weights and FSDP2 hold references to them, taken while they were on the meta device.
    """
    # Swapping exchanges the Python attributes too: marks set on a parameter (expert shards' groups, tied copies)
    # are put back afterwards.
    marks = {p: dict(vars(p)) for p in module.parameters()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        _compat.apply_to_tensors(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for p, attrs in marks.items():
        for key, value in attrs.items():
            vars(p).setdefault(key, value)


@torch.no_grad()
def materialize(
    module: nn.Module,
    templates: InitTemplates,
    views: Callable[[], Mapping[str, Tensor]],
    device: torch.device,
    *,
    seed: int,
    skip: frozenset[str] = frozenset(),
) -> int:
    """Allocate this rank's meta tensors on ``device`` and initialise them unit by unit (module docstring).

    Args:
        module: the cut, sliced and sharded model, still with meta tensors.
        templates: from `capture_init`, taken before the model was transformed.
        views: returns the model's tensors by name in checkpoint view (`lightning_par.checkpoint.dcp.model_state`:
            full shapes, DTensors where a rank holds a part); called once the storage exists.
        device: where this rank's tensors live.
        seed: the job's seed (`base_seed`), equal on every rank.
        skip: names whose values come from elsewhere (pretrained weights): allocated, not initialised.

    Returns:
        the number of units initialised on this rank.
    """
    allocate(module, device)
    by_name = views()
    wanted: dict[str, list[Tensor]] = {}
    for name, view in by_name.items():
        if name in templates.meta_names and name not in skip:
            wanted.setdefault(templates.owner.get(name, name), []).append(view)
    for name, buf in module.named_buffers():  # non-persistent buffers (rotary tables) are not in the state dict
        clean = clean_name(name)
        if clean in templates.meta_names and clean not in by_name:
            wanted.setdefault(clean, []).append(buf)
    by_unit: dict[str, list[str]] = {}
    for name in wanted:
        unit, _ = templates.unit_of(name)
        by_unit.setdefault(unit.name, []).append(name)
    for unit_name in sorted(by_unit, key=list(templates.units).index):
        unit = templates.units[unit_name]
        values = init_unit(unit, device, seed)
        for name in by_unit[unit_name]:
            rel = templates.unit_of(name)[1]
            for into in wanted[name]:
                place_full(values[rel], into)
        del values
    return len(by_unit)
