"""Pretrained weights into any layout: the loader (`load`), the sources it reads (`sources`: safetensors, DCP,
Hugging Face folders), name mapping (`names`), conversion (`convert`) and the report of what was loaded (`report`)."""

from lightning_par.checkpoint.pretrained.load import PretrainedPlan, load_pretrained, prepare_pretrained

__all__ = ["PretrainedPlan", "load_pretrained", "prepare_pretrained"]
