"""Devices and nodes the planner knows: dense peak matrix FLOP/s per precision, memory size and bandwidth, and the
bandwidth of the links inside a node and between nodes. Every value can be overridden (`Device` is a dataclass:
``dataclasses.replace(device("H100-SXM5-80GB"), hbm_gib=...)``).

Sources (datasheet peaks without sparsity): NVIDIA A100 datasheet (r4): 312 TFLOP/s bf16/fp16, 156 tf32, 19.5
fp32, 80 GB HBM2e at 2.039 TB/s, NVLink 600 GB/s; NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) and
datasheet: SXM5 989.4 TFLOP/s bf16, 66.9 fp32, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; NVIDIA H200 datasheet
(2024): H100 SXM's compute, 141 GB HBM3e at 4.8 TB/s; NVIDIA B200 in the DGX B200 datasheet (2024): 2.25 PFLOP/s
dense bf16 per GPU (half the 4.5 sparse), 80 TFLOP/s fp32, 180 GB HBM3e at 7.7 TB/s usable (DGX B200's
1,440 GB / 8 and 64 TB/s / 8), NVLink 5 at 1.8 TB/s. Streaming multiprocessors: 108 (A100), 132 (H100 / H200 SXM),
148 (B200) from the same documents. Host links: PCIe Gen4 x16 (A100, 32 GB/s per direction) and Gen5 x16 (H100,
H200, B200: 64 GB/s). Inter-node: one 400 Gb/s NIC per GPU (50 GB/s), as in DGX
A100 (200 Gb/s: 25 GB/s), DGX H100/H200 and DGX B200. Bandwidths here are per GPU and per direction.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator and the links around it.

    Args:
        name: the key in `DEVICES`.
        peak_flops: dense peak FLOP/s by precision class (``bf16``, ``fp16``, ``tf32``, ``fp32``; ``fp8`` where the
            device has fp8 tensor cores).
        hbm_gib: device memory in GiB.
        hbm_bytes_per_s: device memory bandwidth.
        intra_node_bytes_per_s: per-GPU bandwidth to a GPU of the same node (NVLink), one direction.
        inter_node_bytes_per_s: per-GPU bandwidth to another node (its NIC), one direction.
        gpus_per_node: GPUs in one node of the common system built on it.
        sms: streaming multiprocessors (the GEMM wave quantisation of `lightning_par.planner.compute` counts them).
        gemm_efficiency: the fraction of ``peak_flops`` a large, well-shaped GEMM reaches (assumed, see below).
        memory_efficiency: the fraction of ``hbm_bytes_per_s`` a streaming element-wise kernel reaches (assumed).
        link_efficiency: the fraction of a link's bandwidth a large NCCL collective reaches (assumed).
        collective_latency_s: fixed cost of one collective or point-to-point transfer (assumed).
        pcie_bytes_per_s: host <-> GPU bandwidth, one direction (offloaded state crosses it every step).
        host_memory_bytes_per_s: this GPU's share of the host's memory bandwidth (an offloaded optimizer steps
            there); assumed 50 GB/s, a two-socket server's ~400 GB/s over 8 GPUs.
        reduce_scatter_all_reduces: the backend runs a reduce-scatter as a whole all-reduce (gloo does: pytorch
            PR 118911), so it costs an all-reduce's bytes.
        comm_overlap: the share of an overlappable collective's time that can hide behind compute (1: NCCL runs
            on its own SMs and copy engines; a CPU job whose ranks fill every core has nothing to hide it with: 0).

    The four efficiencies are assumptions, not fits: ``gemm_efficiency`` 0.80 is the share of the datasheet peak that
    cuBLAS's large half-precision GEMMs are commonly reported to sustain on A100 and H100 (the peak assumes the
    boost clock, which power-limited runs do not hold); ``memory_efficiency`` 0.80 and ``link_efficiency`` 0.80 are
    the usual STREAM-like and nccl-tests bus-bandwidth shares; 10 us per collective is NCCL's order of latency on
    NVLink. Override them with `dataclasses.replace` when you have measured your own (docs/planner.md).
    """

    name: str
    peak_flops: dict[str, float]
    hbm_gib: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    sms: int = 108
    gemm_efficiency: float = 0.80
    memory_efficiency: float = 0.80
    link_efficiency: float = 0.80
    collective_latency_s: float = 10e-6
    comm_overlap: float = 1.0
    reduce_scatter_all_reduces: bool = False
    pcie_bytes_per_s: float = 64e9
    host_memory_bytes_per_s: float = 50e9


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("A100-SXM4-40GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
               40e9 / GIB, 1.555e12, 300e9, 25e9, pcie_bytes_per_s=32e9),
        Device("A100-SXM4-80GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
               80e9 / GIB, 2.039e12, 300e9, 25e9, pcie_bytes_per_s=32e9),
        # fp8: the datasheets' dense figures (half of the "with sparsity" ones: H100 3,958 TFLOPS, B200 9 PFLOPS)
        Device("H100-SXM5-80GB", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12,
                                  "fp8": 1978.9e12},
               80e9 / GIB, 3.35e12, 450e9, 50e9, sms=132),
        Device("H200-SXM-141GB", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12,
                                  "fp8": 1978.9e12},
               141e9 / GIB, 4.8e12, 450e9, 50e9, sms=132),
        Device("B200-SXM-180GB", {"bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15, "fp32": 80e12, "fp8": 4.5e15},
               180e9 / GIB, 7.7e12, 900e9, 50e9, sms=148),
    )
}  # fmt: skip
ALIASES = {"A100": "A100-SXM4-80GB", "H100": "H100-SXM5-80GB", "H200": "H200-SXM-141GB", "B200": "B200-SXM-180GB"}


def device(name: str) -> Device:
    """The device called ``name`` (a key of `DEVICES` or a short alias such as ``"H100"``, any case).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    keys = {k.lower(): k for k in (*DEVICES, *ALIASES)}
    key = keys.get(name.lower())
    if key is None:
        known = ", ".join([*DEVICES, *ALIASES])
        raise ValueError(
            f"unknown GPU {name!r}; known: {known}. Describe another with lightning_par.planner.devices.Device(...)"
        )
    return DEVICES[ALIASES.get(key, key)]
