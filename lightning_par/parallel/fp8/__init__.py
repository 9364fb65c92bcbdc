"""fp8 training of the trunk's linear layers on torchao's float8 recipe (`convert`), the weights' scales under ZeRO-3
(`scales`), a unit of fp8 weights all-gathered as bytes (`gather`)."""

from lightning_par.parallel.fp8.convert import Fp8Error, Fp8Layers, check_fp8_device, convert_fp8, select_fp8
from lightning_par.parallel.fp8.gather import BytesAllGather
from lightning_par.parallel.fp8.scales import precompute_scales

__all__ = [
    "BytesAllGather", "Fp8Error", "Fp8Layers", "check_fp8_device", "convert_fp8", "precompute_scales", "select_fp8",
]
