"""Which strategies a model can train under, and why the others cannot: the checks set-up runs, without processes.

Each dimension a strategy name uses has one check here, and every check calls the same code set-up calls before
training (plan inference, trunk detection, the pipeline's ownership rules, MoE recognition, the optimizer rule of
ZeRO-1/2), so a verdict cannot drift from what training does. A strategy works when every dimension it uses does;
its reason is the first failing dimension's message (which names the fix) or a summary of what each found.
``lightning-par check --config RECIPE`` prints the table (`lightning_par.cli`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.names import ALIASES, DEEPSPEED_STRATEGY_NAMES, STRATEGY_NAMES, strategy_kwargs
from lightning_par.parallel.experts.finder import find_moe_layers, unrecognised_experts
from lightning_par.parallel.optimizers import check_dtensor_step, check_elementwise, check_per_parameter, is_elementwise
from lightning_par.parallel.pipeline.cuts import allowed_cuts, no_split_possible
from lightning_par.parallel.pipeline.owners import PipelineError, find_ownership
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.plan import infer_tp_plan
from lightning_par.parallel.tensor.plan_types import _SPLIT_NORMS, TPPlanError
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.parallel.zero.whole import check_not_tp_sharded


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether one strategy name can train the model.

    Args:
        strategy: the registered name (``"pipe_tp"``).
        ok: every dimension it uses passed its check.
        reason: what the checks found; for a failure, the first failing check's message, which names the fix.
    """

    strategy: str
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class _Result:
    ok: bool
    reason: str


def _guard(fn: Callable[[], str], *errors: type[Exception]) -> _Result:
    try:
        return _Result(True, fn())
    except errors as e:
        return _Result(False, str(e).splitlines()[0])


class _Checks:
    """One check per dimension, each run once (a strategy name reuses the results of the dimensions it uses)."""

    def __init__(self, module: nn.Module, optimizer: Optional[torch.optim.Optimizer], degree: int) -> None:
        self.module, self.optimizer, self.degree = module, optimizer, degree
        self._done: dict[str, _Result] = {}

    def get(self, dim: str) -> _Result:
        if dim not in self._done:
            name, _, arg = dim.partition(":")  # "shard_optimizer:2": a check of ZeRO stage 2
            self._done[dim] = getattr(self, f"_{name}")(*([int(arg)] if arg else []))
        return self._done[dim]

    def _tp(self) -> _Result:
        def run() -> str:
            plan = infer_tp_plan(self.module)
            validate_tp(plan, self.degree)
            check_local_shapes(self.module, plan, self.degree)  # block 0 on per-rank shapes, as set-up runs it
            whole = f"; kept whole on every tp rank: {', '.join(plan.whole)} (mixture of experts)" if plan.whole else ""
            # Split with the heads (parallel/tensor/heads.py): q/k norms by style, an attention's per-head parameters.
            leaf = [f"{k.rsplit('.', 1)[-1]} ({s})" for k, s in plan.styles.items() if s in _SPLIT_NORMS]
            leaf += [f"{p.rsplit('.', 1)[-1]} (per head)" for h in plan.heads.values() for p in h.head_params]
            heads = f"; split with the heads: {', '.join(leaf)}" if leaf else ""
            if plan.groups:  # blocks that differ: each structure planned from its first block
                per = f" over {len(plan.groups)} block structures ({', '.join(plan.groups)})"
                latent = [p.rsplit(".", 1)[-1] for h in plan.heads.values() for p in h.latent]
                per += f"; latent attention, kept whole: {', '.join(dict.fromkeys(latent))}" if latent else ""
            else:
                per = " per block"
            return f"tp plan: {len(plan.heads)} attention and {len(plan.mlps)} MLP regions{per}{heads}{whole}"

        return _guard(run, TPPlanError)

    def _pp(self) -> _Result:
        def run() -> str:
            trunk = find_trunk(self.module)
            if trunk is None:
                raise PipelineError(
                    "found no trunk of >= 2 same-class blocks to cut into stages; train with zero3 or tp instead"
                )
            own = find_ownership(self.module, trunk)
            trunk, blocks = (own.calls, "calls") if own.calls is not None else (trunk, "blocks")
            if len(trunk.blocks) < self.degree:
                raise PipelineError(
                    f"{trunk.path} has {len(trunk.blocks)} {blocks}, fewer than pp={self.degree} stages; use fewer "
                    "pipeline ranks"
                )
            if (why := no_split_possible(own.cut_conflicts, trunk.names, self.degree)) is not None:
                raise PipelineError(why)
            outside = f"{len(own.pre)} modules on the first stage, {len(own.post)} on the last, by {own.source}"
            tied = f", {len(own.tied)} tied weights on both" if own.tied else ""
            sides = f", {len(own.sides)} side outputs carried to the last stage ({own.sides[0].name}, ...)" if (
                own.sides) else ""  # fmt: skip
            ruled_out = f", cuts only before blocks {allowed_cuts(len(trunk.blocks), own.cut_conflicts)}" if (
                own.cut_conflicts) else ""  # fmt: skip
            shared = f", {', '.join(trunk.repeated)} on every stage (run more than once)" if trunk.repeated else ""
            return (f"pipeline over the {len(trunk.blocks)} {blocks} of {trunk.path} "
                    f"({outside}{tied}{sides}{ruled_out}{shared})")  # fmt: skip

        return _guard(run, PipelineError)

    def _cp(self) -> _Result:
        trunk = find_trunk(self.module)
        if trunk is None:
            return _Result(False, "found no trunk of >= 2 same-class blocks to split the sequence in; train without cp")
        # Hugging Face models name their attention path in the config; other models are checked at the first forward.
        configs = {id(c): c for m in self.module.modules() if (c := getattr(m, "config", None)) is not None}
        impls = {str(i) for c in configs.values() if (i := getattr(c, "_attn_implementation", None)) is not None}
        if impls - {"sdpa"}:
            return _Result(
                False,
                f"attention runs as {sorted(impls - {'sdpa'})[0]!r}, not scaled_dot_product_attention; build the model "
                "with attn_implementation='sdpa', or train without cp",
            )
        how = "sdpa attention" if impls else "attention checked at the first forward (it must call SDPA)"
        return _Result(True, f"sequence split over cp inside the {len(trunk.blocks)} blocks of {trunk.path} ({how})")

    def _ep(self) -> _Result:
        layers = find_moe_layers(self.module)
        unknown = unrecognised_experts(self.module, layers)
        if unknown:  # the refusal expert parallelism's set-up raises
            return _Result(False, f"experts not recognised in {unknown[0]}; train with zero3 or ep=1")
        if not layers:
            return _Result(False, "no mixture-of-experts layer recognised; train with zero3, tp or pipe instead")
        bad = [m for m in layers if m.n_experts % self.degree]
        if bad:
            return _Result(
                False,
                f"{bad[0].name} has {bad[0].n_experts} experts, which ep={self.degree} does not divide; choose an ep "
                f"that divides {bad[0].n_experts}",
            )
        return _Result(True, f"{len(layers)} MoE layers ({layers[0].kind}, {layers[0].n_experts} experts)")

    def _optimizer_check(self, check: Callable[[torch.optim.Optimizer], str]) -> _Result:
        optimizer = self.optimizer
        if optimizer is None:
            return _Result(True, "no optimizer to check")
        return _guard(lambda: check(optimizer), ValueError)

    def _shard_optimizer(self, stage: int) -> _Result:
        # ZeRO-1/2 (native): row slices for an element-wise optimizer, whole parameters one owner each otherwise.
        def run(optimizer: torch.optim.Optimizer) -> str:
            check_per_parameter(optimizer, stage)
            name = type(optimizer).__name__
            if is_elementwise(optimizer):
                return f"{name} updates element by element, so row shards step exactly"
            return f"{name} is not known to be element-wise, so each rank steps the whole parameters it owns"

        return self._optimizer_check(run)

    def _tp_shard_optimizer(self, stage: int) -> _Result:
        def run(optimizer: torch.optim.Optimizer) -> str:
            if not is_elementwise(optimizer):
                check_not_tp_sharded(type(optimizer).__name__, stage, ["each column- or row-split weight"])
            return "tensor-parallel shards step element by element"

        return self._optimizer_check(run)

    def _tp_optimizer(self) -> _Result:
        # Stage 0 steps the tensor-parallel DTensors themselves (parallel/run.py).
        def run(optimizer: torch.optim.Optimizer) -> str:
            check_dtensor_step(optimizer, "tensor parallelism", "Use tp=1, or an element-wise optimizer such as AdamW")
            return f"no known limit of {type(optimizer).__name__} on tensor-parallel DTensor parameters"

        return self._optimizer_check(run)

    def _deepspeed_optimizer(self) -> _Result:
        def run(optimizer: torch.optim.Optimizer) -> str:
            check_elementwise(optimizer, "DeepSpeed: it steps the optimizer on flat fp32 partitions")
            return f"{type(optimizer).__name__} updates element by element, so flat partitions step exactly"

        return self._optimizer_check(run)

    def _fsdp_optimizer(self) -> _Result:
        def run(optimizer: torch.optim.Optimizer) -> str:
            check_dtensor_step(optimizer, "zero_stage=3 (FSDP2)")
            return f"no known limit of {type(optimizer).__name__} on FSDP2's DTensor parameters"

        return self._optimizer_check(run)

    def _zero3(self) -> _Result:
        trunk = find_trunk(self.module)
        units = f"{len(trunk.blocks)} blocks of {trunk.path}" if trunk else "the whole model as one unit"
        return _Result(True, f"sharded by {units}")


def _dims(kwargs: dict) -> list[str]:
    dims = [d for d in kwargs["auto_dims"] if d != "dp"]
    stage = kwargs["zero_stage"]
    if stage in (1, 2):
        dims += [f"shard_optimizer:{stage}", *([f"tp_shard_optimizer:{stage}"] if "tp" in dims else [])]
    elif stage == 3:
        dims += ["zero3", "fsdp_optimizer"]
    elif "tp" in dims:
        dims += ["tp_optimizer"]
    return dims


def first_optimizer(configured: Any) -> Optional[torch.optim.Optimizer]:
    """The first optimizer of what ``configure_optimizers`` returns: an optimizer, a list or tuple of them (and
    schedulers), or a dict."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return first_optimizer(configured[0])
    return None


def check_model(
    module: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    strategies: Optional[Iterable[str]] = None,
    degree: int = 2,
) -> list[Verdict]:
    """Check every strategy name (or ``strategies``) against ``module``, as set-up would on ``degree`` ranks per
    dimension.

    Args:
        module: the user's module; it is only inspected (the tp plan probe runs one forward in eval mode).
        optimizer: what the module's ``configure_optimizers`` returns (DeepSpeed and tensor parallelism under
            ZeRO-1/2 need an element-wise one, ZeRO-1/2 one whose step does not couple parameters, ZeRO-3 one that
            steps DTensors); ``None`` skips that check.
        strategies: names to check (default: every registered name but the aliases).
        degree: the degree each dimension is checked for (tp, pp, ep).
    """
    checks = _Checks(module, optimizer, degree)
    names = list(strategies) if strategies is not None else [
        n for n in (*STRATEGY_NAMES, *DEEPSPEED_STRATEGY_NAMES) if n not in ALIASES
    ]  # fmt: skip
    out = []
    for name in names:
        deepspeed = name.startswith("deepspeed_")
        base = name[len("deepspeed_") :].replace("_nvme", "_offload") if deepspeed else name
        try:
            dims = _dims(strategy_kwargs(base))
        except (NotImplementedError, ValueError) as e:
            out.append(Verdict(name, False, str(e).splitlines()[0]))
            continue
        if deepspeed:  # DeepSpeed steps every stage's optimizer on flat partitions (its own, not ours or FSDP2's)
            dims = [d for d in dims if "_optimizer" not in d] + ["deepspeed_optimizer"]
        results = [(d, checks.get(d)) for d in dims]
        failed = [r for _, r in results if not r.ok]
        reason = failed[0].reason if failed else "; ".join(r.reason for _, r in results) or "plain data parallel"
        out.append(Verdict(name, not failed, reason))
    return out


def format_verdicts(verdicts: Iterable[Verdict]) -> str:
    """The table ``lightning-par check`` prints: one line per strategy, ``ok`` or ``no`` and the reason."""
    rows = list(verdicts)
    width = max(len(v.strategy) for v in rows)
    return "\n".join(f"{v.strategy:<{width}}  {'ok' if v.ok else 'no':<2}  {v.reason}" for v in rows)
