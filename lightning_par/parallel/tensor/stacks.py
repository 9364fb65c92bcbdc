"""Tensor parallelism over every stack of blocks, not the trunk alone: an encoder-decoder's encoder.

The trunk (`blocks.trunk.find_trunk`) is the stack a pipeline cuts and ZeRO-3 wraps: for Hugging Face T5 or BART the
decoder, which holds the most parameters. The encoder is a second stack of the same kind of blocks, and kept whole
it would hold its whole weights on every tp rank. Each other stack (`blocks.trunk.other_trunks`: >= 2 same-class
blocks outside the trunk, 10 % of the model or more) gets a plan of its own, inferred, validated and checked on real
values exactly as the trunk's (`infer_tp_plan(trunk=)`), and is split with it. A stack whose plan is refused stays
whole, as before, and the start-up log says so with the reason: the trunk's own refusals still stop the run.
Under a pipeline a stack belongs to a stage's outer modules (an encoder to the first stage) and is split on that
stage's ranks, without sequence parallelism (`compose._tensor_parallel`).
"""

from __future__ import annotations

from torch import nn

from lightning_par.blocks.trunk import other_trunks
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.plan import infer_tp_plan
from lightning_par.parallel.tensor.plan_types import TPPlan, TPPlanError
from lightning_par.parallel.tensor.plan_validate import validate_tp


def other_plans(
    model: nn.Module, main: TPPlan, tp: int, overrides: dict[str, str] | None = None
) -> tuple[list[TPPlan], list[str]]:
    """Plans for the model's other stacks of blocks, and a note for each kept whole.

    Args:
        model: the whole model (before any split).
        main: the trunk's plan.
        tp: the tensor-parallel degree.
        overrides: the user's ``tp_plan``; a stack takes the patterns under its own path.
    """
    plans: list[TPPlan] = []
    notes: list[str] = []
    for stack in other_trunks(model, main.trunk):
        mine = {k: v for k, v in (overrides or {}).items() if k.startswith(stack.path + ".")}
        try:
            plan = infer_tp_plan(model, overrides=mine, trunk=stack)
            validate_tp(plan, tp)
            plans.append(check_local_shapes(model, plan, tp))
        except TPPlanError as err:
            first = str(err).splitlines()[0]
            notes.append(f"tensor parallel: {stack.path} kept whole on every rank ({first})")
    return plans, notes
