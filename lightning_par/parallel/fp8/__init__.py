"""fp8 training of the trunk's linear layers on torchao's float8 recipe (`convert`), the weights' scales under ZeRO-3
(`scales`), a unit of fp8 weights all-gathered as bytes (`gather`), sequence parallelism's region inputs gathered in
fp8 (`sequence`)."""

from lightning_par.parallel.fp8.convert import Fp8Error, Fp8Layers, check_fp8_device, convert_fp8, select_fp8
from lightning_par.parallel.fp8.gather import BytesAllGather
from lightning_par.parallel.fp8.scales import precompute_scales
from lightning_par.parallel.fp8.sequence import fp8_gathers, gather_note, gather_ready

__all__ = [
    "BytesAllGather",
    "Fp8Error",
    "Fp8Layers",
    "check_fp8_device",
    "convert_fp8",
    "fp8_gathers",
    "gather_note",
    "gather_ready",
    "precompute_scales",
    "select_fp8",
]
