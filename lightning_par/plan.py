"""The planner's public names under their first import path (`lightning_par.planner` is the package, named apart
from the tensor-parallel plan of `lightning_par.parallel.tensor`): ``from lightning_par.plan import device`` keeps
working."""

from lightning_par.planner import DEVICES, Device, ModelDesc, device, from_hf_config

__all__ = ["DEVICES", "Device", "ModelDesc", "device", "from_hf_config"]
