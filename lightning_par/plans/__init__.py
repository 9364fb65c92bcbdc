"""Model introspection without process groups: the trunk of repeated blocks and a tensor-parallel plan for them."""

from lightning_par.plans.tp import infer_tp_plan
from lightning_par.plans.tp_types import STYLES, HeadInfo, MLPInfo, ModuleShape, TPPlan, TPPlanError
from lightning_par.plans.tp_validate import format_plan, validate_tp
from lightning_par.plans.trunk import Trunk, find_trunk

__all__ = [
    "STYLES",
    "HeadInfo",
    "MLPInfo",
    "ModuleShape",
    "TPPlan",
    "TPPlanError",
    "Trunk",
    "find_trunk",
    "format_plan",
    "infer_tp_plan",
    "validate_tp",
]
