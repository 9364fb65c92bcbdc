"""Tensor (and sequence) parallelism: the plan inferred from the model's blocks (`plan`, `plan_*`), its application
(`apply`),
the checks before the first step (`check`) and the run-time pieces (`sequence`, `heads`, `latent`, `affine`)."""

from lightning_par.parallel.tensor.apply import apply_tensor_parallel
from lightning_par.parallel.tensor.plan import infer_tp_plan
from lightning_par.parallel.tensor.plan_types import STYLES, HeadInfo, MLPInfo, ModuleShape, TPPlan, TPPlanError
from lightning_par.parallel.tensor.plan_validate import format_plan, validate_tp

__all__ = [
    "STYLES",
    "HeadInfo",
    "MLPInfo",
    "ModuleShape",
    "TPPlan",
    "TPPlanError",
    "apply_tensor_parallel",
    "format_plan",
    "infer_tp_plan",
    "validate_tp",
]
