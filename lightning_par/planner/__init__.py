"""The planner (work in progress, issue 17): model shapes from a live module or a Hugging Face ``config.json``
(`model.py`) and the devices it plans for (`devices.py`). Pure Python: no process group, no Lightning."""

from lightning_par.planner.devices import DEVICES, Device, device
from lightning_par.planner.model import ModelDesc, from_hf_config

__all__ = ["DEVICES", "Device", "ModelDesc", "device", "from_hf_config"]
