"""gpu_check.py section (3): activation memory of each activation-checkpointing policy, measured and predicted.

Prediction: Korthikanti et al.'s method (arXiv 2205.05198, section 4.1: count the bytes every op saves for its
backward) applied to `lightning_par.models.Llama` under bf16 autocast, whose blocks differ from the paper's GPT
(RMSNorm, rotary in fp32, grouped-query attention with repeated K/V, SwiGLU, no dropout, fused attention that keeps
no s x s matrix, an fp32 residual stream). T = tokens (batch x sequence), h = width, k = K/V width, f = SwiGLU width,
a = heads, r = query heads per K/V head, V = vocabulary, W = the block's matmul weights (2h^2 + 2hk + 3hf). Bytes
one block saves (each term checked op by op with a dispatch mode that lists the live storages and their creators):

    RMSNorm before attention   4Th (fp32 input) + 4T (rsqrt) + 4Th (normalized) + 3 x 2Th (bf16 casts for q, k, v)
    q                          2Th (rotated, bf16, kept by attention; the fp32 rotary copies are not kept: the
                               rotary table needs no gradient, so its products keep only the table)
    k, v                       2 x 2Th if r > 1 (the repeated heads attention keeps) else 2 x 2Tk
    attention                  2Th (output, already laid out for wo) + 4Ta (log-sum-exp)
    RMSNorm before the MLP     4Th + 4T + 4Th + 2 x 2Th (bf16 casts for w1, w3)
    SwiGLU                     4 x 2Tf (w1 out, silu out, w3 out, product)
    weights                    2W: autocast's bf16 copy of each weight, kept by its matmul until backward (a term
                               the paper has not: Megatron keeps bf16 weights; under FSDP2's bf16 parameters the
                               casts are no-ops and this term is 0, but this section measures a plain module)

and the head keeps 4Th + 4T + 4Th + 2Th (final RMSNorm, cast) + 4TV (fp32 log-softmax of the logits) + 2Vh (its
weight's cast). Policies:
``full`` keeps each block's fp32 input (4Th); ``selective`` does so for every second block (blocks 0, 2, ...);
``selective_op`` keeps the input, the matmul outputs (2Th q, 2 x 2Tk k v, 2Th wo, 2 x 2Tf w1 w3, 2Th w2) and the
attention outputs (2Th + 4Ta); ``offload`` keeps nothing of the blocks on the device (their saved tensors go to
host memory) but the tensors under 1 KiB it leaves there (the two 4T rsqrt terms where 4T < 1 KiB). Measured: bytes
of tensors created by forward + loss still alive before backward, parameters excluded (`LiveStorageBytes` on CPU,
less what the offload holds in "host" memory, the same memory there; ``torch.cuda.memory_allocated`` deltas on
CUDA), and on CUDA the peak over forward + backward too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from _gpu_fits import LLAMA_1B

from lightning_par.blocks.trunk import find_trunk
from lightning_par.models import Llama
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.parallel.activation_offload import MIN_BYTES, offload_of
from lightning_par.utils import LiveStorageBytes

# "offload:2": the first 2 blocks offloaded (`offload_blocks`), the others holding what they hold without.
POLICIES: tuple[Optional[str], ...] = (None, "full", "selective", "selective_op", "offload", "offload:2")


def predicted_bytes(config: dict[str, int], batch: int, policy: Optional[str], device: str) -> int:
    """Activation bytes the formula in this module's docstring gives for ``policy`` (None: no checkpointing)."""
    T, h, f = batch * config["max_seq_len"], config["dim"], config["ffn_hidden"]
    a, L = config["n_heads"], config["n_layers"]
    k = config["n_kv_heads"] * h // a
    r = a // config["n_kv_heads"]
    kv = 4 * T * h if r > 1 else 4 * T * k
    weights = 2 * (2 * h * h + 2 * h * k + 3 * h * f)
    block = (14 * T * h + 4 * T) + 2 * T * h + kv + (2 * T * h + 4 * T * a) + (12 * T * h + 4 * T) + 8 * T * f + weights
    head = 10 * T * h + 4 * T + 4 * T * config["vocab_size"] + 2 * config["vocab_size"] * h
    kept_input = 4 * T * h
    if policy is None:
        return L * block + head
    if policy == "full":
        return L * kept_input + head
    if policy == "selective":
        picked = len(range(0, L, 2))
        return picked * kept_input + (L - picked) * block + head
    if policy == "selective_op":
        matmuls = 2 * T * h + 4 * T * k + 2 * T * h + 4 * T * f + 2 * T * h  # q; k, v; wo; w1, w3; w2
        return L * (kept_input + matmuls + 2 * T * h + 4 * T * a) + head  # + attention's output and log-sum-exp
    if policy is not None and policy.startswith("offload"):
        n = int(policy.partition(":")[2] or L)
        return head + (L - n) * block + n * (2 * 4 * T if 4 * T < MIN_BYTES else 0)  # rsqrt terms under 1 KiB stay
    raise ValueError(f"unknown policy {policy!r}")


def _loss(model: Llama, x: torch.Tensor, device: str) -> torch.Tensor:
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())  # logits are freed: only saved tensors stay


def measure(config: dict[str, int], batch: int, policy: Optional[str], device: str) -> dict[str, Any]:
    """Held-after-forward bytes (and on CUDA the forward + backward peak) of one step of ``policy``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(**config)
    mode, _, count = (policy or "").partition(":")
    apply_activation_checkpointing(find_trunk(model).blocks, mode or None, model=model,
                                   count=int(count) if count else None)  # fmt: skip
    x = torch.randint(0, config["vocab_size"], (batch, config["max_seq_len"]), device=device)
    predicted = predicted_bytes(config, batch, policy, device)
    out: dict[str, Any] = {"policy": policy or "none", "predicted_bytes": predicted}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = _loss(model, x, device)
        torch.cuda.synchronize()
        out["held_bytes"] = torch.cuda.memory_allocated() - start
        loss.backward()
        torch.cuda.synchronize()
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - start
    else:
        offload = offload_of(find_trunk(model).blocks[0])
        with LiveStorageBytes() as live:
            loss = _loss(model, x, device)
            out["held_bytes"] = live.now() - (offload.host_bytes if offload is not None else 0)
        loss.backward()
    out["measured_over_predicted"] = out["held_bytes"] / out["predicted_bytes"]
    return out


def activations(accelerator: str, smoke: bool) -> dict[str, Any]:
    """Section (3) for the 1 B configuration cut to 4 blocks (batch 1, sequence 2048), or a small one in smoke."""
    if smoke:
        config = dict(vocab_size=256, max_seq_len=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256)
    else:
        config = dict(LLAMA_1B, n_layers=4)
    rows = [measure(config, 1, policy, accelerator) for policy in POLICIES]
    return {"config": config, "batch": 1, "rows": rows}
