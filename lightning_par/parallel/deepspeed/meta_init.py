"""Meta-built models under DeepSpeed's ZeRO: the native backend's initial weights, one unit in memory at a time.

A model built in ``configure_model()`` or under ``trainer.init_module(empty_init=True)`` is on the meta device with
either backend (`ParallelStrategy`'s contexts). Before ``deepspeed.initialize`` it needs storage and values; this
file gives it the values `lightning_par.parallel.materialize` gives it natively (`init_unit`: the model's own rules
on one unit at a time, seeded by the unit's name), so a run starts from bitwise the same weights on either backend,
on any world size, one process included.

- ZeRO-1/2: every rank holds the full parameters anyway. The whole module is materialised exactly as natively
  (`materialize` over plain state-dict views), then the engine casts and partitions it as it would an eager model.
- ZeRO-3: unit by unit, in `capture_init`'s order: `init_unit` builds the unit's full tensors, they become the
  storage of the module's own parameters (swapped in, so every reference to a parameter, a tied one included, stays
  valid), are cast to the engine's compute dtype (what ``deepspeed.initialize`` does to an eager model before it
  partitions it), and DeepSpeed partitions them at once with ``deepspeed.zero.Init(module=...)``, its public "as
  if it was constructed in the context" conversion; later units go through the first parameter's
  ``convert_to_zero_parameters``, as DeepSpeed's own stage-3 engine converts late parameters, so one ``Init`` owns
  every partition (one NVMe swapper, one id counter). A rank then holds its partitions plus one unit's full
  weights, never the model. The engine sees only ZeRO parameters and converts nothing again.

With pretrained weights (``pretrained=``, validated beforehand against the whole model by `prepare_pretrained`),
the names the file fills are read from it instead of initialised: under ZeRO-1/2 into the materialised module (its
initialisation skips them), under ZeRO-3 unit by unit at full size, in place of `init_unit`'s values (which then
run only for a unit holding something the file lacks, such as a rotary table), so the transient is still one unit.

Why not build under ``deepspeed.zero.Init`` (what Lightning's DeepSpeedStrategy does in ``configure_model``):
it patches every ``nn.Module.__init__`` and tensor constructor while the model is built, needs the process group
then (``trainer.init_module`` runs before ``fit`` creates it, which is why Lightning builds that case at full size),
and fills the weights with torch's default rules from the global generator; matching the native values would then
mean gathering and overwriting every unit (one all-gather per unit, on top of the construction-time
partitioning), and `capture_init` would need a second, meta, copy of the model. Keeping the meta build costs
nothing, works for both hooks, and leaves one construction path for both backends.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.checkpoint.dcp import model_state
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.pretrained.load import PretrainedPlan
from lightning_par.config import ParallelConfigError
from lightning_par.parallel.materialize import InitTemplates, capture_init, init_unit, materialize

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what DeepSpeed's engine casts


class DeepSpeedInitError(ParallelConfigError):
    """A meta-built model that this DeepSpeed cannot take; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class MetaInitReport:
    """What materialising a meta-built model cost this rank.

    Args:
        units: the units initialised.
        peak_bytes: the most parameter bytes this rank held at once (ZeRO-3: its partitions so far plus the unit
            being initialised; ZeRO-1/2: the full model).
        full_bytes: the parameter bytes of the whole model (what every rank of an eager build holds).
    """

    units: int
    peak_bytes: int
    full_bytes: int

    def describe(self) -> str:
        """One line for the log."""
        mib = 2**20
        return (
            f"materialised a meta-built model in {self.units} units: at most {self.peak_bytes / mib:.1f} MiB of "
            f"parameters on this rank at once, of {self.full_bytes / mib:.1f} MiB for the whole model"
        )


def check_zero_init_api() -> None:
    """Refuse a DeepSpeed whose ``zero.Init`` cannot partition an already-allocated module.

    Raises:
        DeepSpeedInitError: naming the DeepSpeed version and the fix.
    """
    import deepspeed

    init = getattr(getattr(deepspeed, "zero", None), "Init", None)
    accepted = inspect.signature(init.__init__).parameters if init is not None else {}
    missing = [k for k in ("module", "config_dict_or_path") if k not in accepted]
    if init is None or missing:
        raise DeepSpeedInitError(
            f"DeepSpeed {deepspeed.__version__}: deepspeed.zero.Init lacks {missing or 'itself'}, which a meta-built "
            "model needs under ZeRO-3 (each unit is partitioned as it is initialised); upgrade DeepSpeed "
            "(0.19.8 is tested), or build the model eagerly (outside configure_model() / init_module(empty_init=True))"
        )


def materialize_for_deepspeed(
    module: nn.Module,
    device: torch.device,
    ds_config: dict[str, Any],
    *,
    seed: int,
    pretrained: Optional[PretrainedPlan] = None,
) -> MetaInitReport:
    """Give a meta-built ``module`` this rank's storage and the native backend's initial values (module docstring).

    Collective under ZeRO-3 (DeepSpeed broadcasts and partitions each parameter): every rank calls it.

    Args:
        module: the user's model, with meta parameters and buffers.
        device: this rank's device.
        ds_config: the DeepSpeed config the engine will be built with (stage, precision, offload).
        seed: the job's seed (`lightning_par.parallel.materialize.base_seed`), equal on every rank.
        pretrained: a checkpoint already validated against the module (`prepare_pretrained`): the names it fills
            are read from it instead of initialised (only the rest, such as rotary tables, is).
    """
    templates = capture_init(module, find_trunk(module))
    full = sum(p.numel() * p.element_size() for p in _unique_params(module))
    if int(ds_config.get("zero_optimization", {}).get("stage", 0)) < 3:
        skip = pretrained.names if pretrained is not None else frozenset()
        units = materialize(module, templates, lambda: model_state(module), device, seed=seed, skip=skip)
        if pretrained is not None:
            pretrained.read_into(model_state(module))
        return MetaInitReport(units, full, full)
    check_zero_init_api()
    return _zero3(module, templates, device, ds_config, seed, full, pretrained)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())  # deduplicated: a tied parameter counts once


def _compute_dtype(ds_config: dict[str, Any]) -> Optional[torch.dtype]:
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def _swap_in(param: nn.Parameter, value: Tensor) -> None:
    # The parameter object stays (tied modules and the trainer hold it); its contents become `value`, no copy.
    # swap_tensors exchanges __dict__ too: keep the parameter's own attributes.
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, new)


def _held_bytes(params: list[nn.Parameter]) -> int:
    # What this rank's parameters occupy now: a partition once DeepSpeed converted it, the full tensor before.
    total = 0
    for p in params:
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            total += part.numel() * part.element_size()
        elif not p.is_meta:
            total += p.numel() * p.element_size()
    return total


@dataclasses.dataclass
class _Meta:
    # A meta tensor of one unit: where it is set, its name inside the unit (`init_unit`'s keys) and its module names.
    param: Optional[nn.Parameter]  # a parameter (keeps its identity), or None for a buffer at mod._buffers[key]
    mod: Optional[nn.Module]
    key: str
    rel: str
    names: list[str]

    def shape_dtype(self) -> tuple[torch.Size, torch.dtype]:
        t = self.param if self.param is not None else self.mod._buffers[self.key]  # type: ignore[union-attr]
        assert t is not None
        return t.shape, t.dtype


def _group_by_unit(module: nn.Module, templates: InitTemplates) -> dict[str, list[_Meta]]:
    # Each meta tensor under the unit whose initialisation decides its value (a tied one: its owner's unit).
    units: dict[str, list[_Meta]] = {}
    seen: dict[int, _Meta] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.is_meta:
            clean = clean_name(name)
            if id(p) in seen:
                seen[id(p)].names.append(clean)
                continue
            unit, rel = templates.unit_of(templates.owner.get(clean, clean))
            seen[id(p)] = _Meta(p, None, "", rel, [clean])
            units.setdefault(unit.name, []).append(seen[id(p)])
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for key, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                clean = clean_name(f"{mod_name}.{key}" if mod_name else key)
                unit, rel = templates.unit_of(clean)
                units.setdefault(unit.name, []).append(_Meta(None, mod, key, rel, [clean]))
    return units


def _unit_values(
    unit: Any,
    metas: list[_Meta],
    device: torch.device,
    seed: int,
    low: Optional[torch.dtype],
    pretrained: Optional[PretrainedPlan],
) -> dict[str, Tensor]:
    """The unit's full tensors by name inside it: read from the checkpoint where it fills them, else initialised."""
    filled = {m.rel: next(n for n in m.names if n in pretrained.names) for m in metas
              if pretrained is not None and any(n in pretrained.names for n in m.names)}  # fmt: skip
    values = init_unit(unit, device, seed) if len(filled) < len(metas) else {}
    if filled:
        assert pretrained is not None
        read: dict[str, Tensor] = {}
        for m in metas:
            if m.rel in filled:
                shape, dtype = m.shape_dtype()
                # Read straight into the compute dtype: the same rounding as the cast of an initialised value.
                cast = low is not None and m.param is not None and dtype in _CASTABLE
                values[m.rel] = read[filled[m.rel]] = torch.empty(shape, dtype=low if cast else dtype, device=device)
        pretrained.read_into(read)  # every rank reads the same units in the same order (a DCP source: collective)
    return values


@torch.no_grad()
def _zero3(
    module: nn.Module,
    templates: InitTemplates,
    device: torch.device,
    ds_config: dict[str, Any],
    seed: int,
    full: int,
    pretrained: Optional[PretrainedPlan],
) -> MetaInitReport:
    import deepspeed

    low = _compute_dtype(ds_config)
    by_unit = _group_by_unit(module, templates)
    for mod in module.modules():  # buffers built eagerly: the engine does not move a ZeRO-3 model's buffers
        for key, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta:
                mod._buffers[key] = buf.to(device)
    every = _unique_params(module)
    convert: Optional[Callable[..., Any]] = None
    peak, units = 0, [u for u in templates.units if u in by_unit]
    for unit_name in units:
        values = _unit_values(templates.units[unit_name], by_unit[unit_name], device, seed, low, pretrained)
        fresh = []
        for m in by_unit[unit_name]:
            value = values[m.rel]
            if m.param is None:
                m.mod._buffers[m.key] = value  # type: ignore[union-attr]  # buffers stay whole (never partitioned)
                continue
            _swap_in(m.param, value.to(low) if low is not None and value.dtype in _CASTABLE else value)
            fresh.append(m.param)
        del values
        peak = max(peak, _held_bytes(every))  # the unit whole, before DeepSpeed partitions it
        if not fresh:
            continue
        if convert is None:
            deepspeed.zero.Init(module=nn.ParameterList(fresh), config_dict_or_path=copy.deepcopy(ds_config))
            convert = getattr(fresh[0], "convert_to_zero_parameters", None)
            if convert is None:
                raise DeepSpeedInitError(
                    f"DeepSpeed {deepspeed.__version__}: a ZeRO-3 parameter has no convert_to_zero_parameters, "
                    "which partitions a meta-built model unit by unit; upgrade DeepSpeed (0.19.8 is tested), or "
                    "build the model eagerly (outside configure_model() / init_module(empty_init=True))"
                )
        else:
            convert(param_list=fresh)
    return MetaInitReport(len(units), peak, full)
