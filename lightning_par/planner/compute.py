"""The work of one micro-batch on one GPU: every GEMM with its shape, the bytes the element-wise kernels stream,
and the time each takes on a `Device`.

GEMM time is a roofline with wave quantisation: a GEMM of ``m x n`` outputs is cut into tiles, the tiles run in
waves of one tile per streaming multiprocessor, and the last, partly filled wave costs a full one. So a GEMM whose
tiles fill 5.3 waves runs at 5.3 / 6 of the large-GEMM rate; small or thin GEMMs (a decode-sized batch, a narrow
tensor-parallel slice) lose more, and a GEMM that reads more bytes than it computes is bound by memory bandwidth
instead. Tiles of 256 x 128 and 128 x 128 outputs are tried and the faster kept, as a GEMM library's heuristic
would (the smaller tile is taken to run at 0.9 of the larger's rate: it reuses each operand half as often), and so
is a skinny-shape kernel (split-K or GEMV) that wastes no padded rows but runs at half the large-GEMM rate: without
it a matrix-vector product would be priced as a full 128-row tile of work.

Element-wise work (norms, activations, softmax, dropout, residual adds) is priced by the bytes it reads and
writes at the device's streaming bandwidth. Two profiles say which kernels exist: ``"megatron"`` (Megatron-LM as
in Korthikanti et al., arXiv 2205.05198: fused bias-GeLU, bias-dropout-add and scale-mask-softmax, the attention
core as two batched GEMMs over the full s x s scores) and ``"torch"`` (Hugging Face modules run eagerly with
PyTorch's fused scaled-dot-product attention, which never writes the scores and skips the masked half under a
causal mask).
"""

from __future__ import annotations

import dataclasses
import math

from lightning_par.planner.devices import Device
from lightning_par.planner.layout import Layout, compute_bytes
from lightning_par.planner.model import ModelDesc

PROFILES = ("megatron", "torch")
_TILES = ((256, 128, 1.0), (128, 128, 0.9))  # (rows, cols, rate relative to the large tile)
_SKINNY_RATE = 0.5  # a split-K / GEMV kernel's rate relative to the large tile (assumed)
_PEAK_KEY = {"32-true": "tf32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16", "fp8": "fp8"}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``count`` independent GEMMs of ``m x k`` by ``k x n`` (a batched GEMM when ``count > 1``)."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def peak_flops(dev: Device, precision: str) -> float:
    """The device's dense peak for the matmul precision a Lightning precision flag runs at (fp32 runs as TF32)."""
    return dev.peak_flops[_PEAK_KEY[precision]]


def gemm_time(g: Gemm, dev: Device, precision: str) -> float:
    """Seconds for ``g`` on ``dev``: the faster tiling's wave-quantised compute time, or the time to move its
    operands, whichever is longer."""
    rate = peak_flops(dev, precision) * dev.gemm_efficiency
    if dev.sms == 0:  # a measured host rate: no tiles, no waves
        return g.flops / rate
    best = g.flops / (rate * _SKINNY_RATE)
    for rows, cols, rel in _TILES:
        tiles = math.ceil(g.m / rows) * math.ceil(g.n / cols) * g.count
        filled = g.m * g.n * g.count / (math.ceil(tiles / dev.sms) * dev.sms * rows * cols)
        best = min(best, g.flops / (rate * rel * filled))
    moved = (g.m * g.k + g.k * g.n + g.m * g.n) * g.count * compute_bytes(precision)
    return max(best, moved / (dev.hbm_bytes_per_s * dev.memory_efficiency))


def block_gemms(desc: ModelDesc, layout: Layout, seq_len: int, profile: str) -> list[Gemm]:
    """The forward GEMMs of one transformer block for one micro-batch on one GPU (tensor-, context- and
    expert-parallel shares applied; an MoE layer's experts as the tokens routed to this rank's experts)."""
    t, b, d = layout.tp, layout.micro_batch_size, desc.head_dim
    s = seq_len // layout.cp
    tokens = b * s
    heads, kv = desc.heads // t, max(1, desc.kv_heads // t)
    kv_len = seq_len  # context parallel: local queries against every key
    # The attention core: full s x s under "megatron" (2022 kernels) and PyTorch's unfused path (taken with
    # dropout); a causal flash kernel skips the masked half.
    core_rows = s if profile == "megatron" or desc.dropout > 0 else max(1, s // 2)
    gemms = [
        Gemm("qkv", tokens, (heads + 2 * kv) * d, desc.hidden),
        Gemm("scores", core_rows, kv_len, d, b * heads),
        Gemm("context", core_rows, d, kv_len, b * heads),
        Gemm("out", tokens, desc.hidden, heads * d),
    ]
    mats = 3 if desc.gated_mlp else 2
    ffn_local = desc.ffn // t
    if desc.experts:
        # top_k of the experts see each token; ep ranks split the experts and so the routed tokens, evenly on average.
        routed = tokens * desc.top_k
        gemms.append(Gemm("router", tokens, desc.experts, desc.hidden))
        per_expert = max(1, routed // desc.experts)
        local = desc.experts // layout.ep
        gemms += [Gemm("expert_in", per_expert, ffn_local, desc.hidden, local * (mats - 1)),
                  Gemm("expert_out", per_expert, desc.hidden, ffn_local, local)]  # fmt: skip
        # With ep the rank computes the tokens routed to its experts from every ep rank: ep x its own share.
        gemms = [dataclasses.replace(g, m=g.m * layout.ep) if g.name.startswith("expert") else g for g in gemms]
    else:
        gemms += [
            Gemm("mlp_in", tokens, ffn_local, desc.hidden, mats - 1),
            Gemm("mlp_out", tokens, desc.hidden, ffn_local),
        ]
    return gemms


def head_gemms(desc: ModelDesc, layout: Layout, seq_len: int) -> list[Gemm]:
    """The output projection over the vocabulary (last stage), split over tp as a vocabulary-parallel head."""
    tokens = layout.micro_batch_size * seq_len // layout.cp
    return [Gemm("logits", tokens, math.ceil(desc.vocab / layout.tp), desc.hidden)]


def block_elementwise_bytes(desc: ModelDesc, layout: Layout, seq_len: int, profile: str) -> float:
    """Bytes the element-wise kernels of one block read and write in the forward of one micro-batch on one GPU.

    Counted as (reads + writes) of each kernel's tensors, in units of the residual stream ``bsh`` (split over tp
    under sequence parallelism) and of the per-rank MLP and attention-score tensors:

    - ``"megatron"``: two LayerNorms (read + write: 2 x 2 bsh), two fused bias-dropout-adds (read 2, write 1,
      mask 1/2 per element: 2 x 3.5 bsh), fused bias-GeLU (read and write the ``ffn`` activation), the fused
      scale-mask-softmax (read and write the scores) and attention dropout (read, write, 1-byte mask).
    - ``"torch"``: eager PyTorch, kernel by kernel (reads + writes of each): RMSNorm in fp32 (square, mean, scale,
      weight: 7 passes) or the native LayerNorm (2); residual adds (3 each); dropout where the model has it (mask,
      then multiply: 4 per site, and over the s x s probabilities); rotary on q and k (two multiplies, the
      half-rotation and an add: 12); the activation (SiLU and the gate product: 5 passes of the MLP width; exact
      GeLU: 2; GPT-2's tanh GeLU, eight kernels: 18); attention as SDPA's fused kernel (q, k, v read, the output
      written) or, with dropout, its unfused path (scale, mask, softmax and dropout over the scores: 12 passes).
    """
    el = compute_bytes(layout.precision)
    t = layout.tp
    tokens = layout.micro_batch_size * seq_len // layout.cp
    resid = tokens * desc.hidden * el / (t if layout.sequence_parallel else 1)
    active = desc.top_k if desc.experts else 1
    ffn = tokens * desc.ffn * active * el / t
    heads = desc.heads / t
    q = tokens * heads * desc.head_dim * el
    kv = tokens * max(1.0, desc.kv_heads / t) * desc.head_dim * el
    scores = layout.micro_batch_size * heads * (seq_len // layout.cp) * seq_len * el
    if profile == "megatron":
        norms = 2 * 2 * resid
        dropout_add = 2 * 3.5 * resid
        act = 2 * ffn + (ffn if desc.gated_mlp else 0)
        core = 2 * scores + 2.5 * scores
        return norms + dropout_add + act + core
    norm_passes = 2 * (2 if desc.layernorm else 7) * resid
    adds = 2 * 3 * resid
    dropout = 2 * 4 * resid if desc.dropout > 0 else 0.0
    rotary = 0.0 if desc.learned_positions else 12 * (q + kv)
    act = {"silu": 5, "gelu": 2, "gelu_tanh": 18}[desc.activation] * ffn
    attention = 12 * scores if desc.dropout > 0 else q + 2 * kv + q
    return norm_passes + adds + dropout + rotary + act + attention
