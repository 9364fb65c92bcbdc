"""Per-GPU activation memory of a decoder transformer under a `Layout`, counted tensor by tensor.

The method of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv
2205.05198, section 4): list what each op of a block keeps for its backward and add the bytes. Two implementation
profiles say which tensors those are:

- ``"megatron"``: the paper's GPT in Megatron-LM (fp16 activations, 1-byte dropout masks, fused bias-GeLU and
  bias-dropout-add, the attention core as two batched GEMMs over full s x s scores). It reproduces Table 2 exactly:
  per layer ``sbh(34 + 5as/h)``; ``sbh(10 + 24/t + 5as/(ht))`` under tensor parallelism; ``sbh/t(34 + 5as/h)``
  with sequence parallelism; selective recomputation drops the ``5as/h`` attention-core term; full recomputation
  keeps the layer input, ``2sbh`` (``/t`` with sequence parallelism). Extended, in the paper's conventions, to
  grouped-query attention (K and V of ``kv_heads``), gated MLPs (gate and up outputs plus their product), mixtures
  of experts (router logits in fp32, ``top_k`` experts' activations per token) and context parallelism (s / cp).
- ``"torch"``: what PyTorch eager autograd keeps for Hugging Face Llama- (Mistral, Qwen3, Mixtral) and GPT-2-style
  blocks, as measured op by op on CPU with `lightning_par.utils.LiveStorageBytes` (``tests/test_plan_activations.py``):
  HF runs attention through ``scaled_dot_product_attention`` (``attn_implementation="sdpa"``, HF's and the suite's
  default); its CPU flash kernel keeps output and log-sum-exp, no s x s matrix, and takes the key/value heads
  without repeating them. ``attention="eager"``, and dropout > 0 (which sends sdpa to its math path, in fp32 on CPU
  whatever the inputs), keep the s x s probabilities, the repeated K / V and copies laid out for the batched
  matmuls. RMSNorm runs in fp32; autocast (``bf16-mixed``) casts every linear's input and weight separately and
  keeps the copies; CPU dropout keeps a mask of the activation's dtype (CUDA's fused dropout keeps 1 byte); the
  experts run as HF's grouped GEMM. Under tensor parallelism the suite splits the blocks' linears (not the head),
  and under sequence parallelism each region keeps its all-gathered input whole (Megatron-LM gathers it again in
  the backward instead).

Recomputation (``Layout.recompute``): ``"full"`` keeps each block's input; ``"selective"`` is the paper's under
``"megatron"`` and the suite's op-level policy (``activation_checkpointing="selective_op"``: every output of a
matmul or attention kernel is kept, whether or not autograd needs it; the rest is recomputed) under ``"torch"``;
``"offload"`` (the suite's activation offload) keeps on the device only what is too small to move, and in a
block's backward holds its tensors back and the next block's prefetched.

A pipeline rank holds several micro-batches at once (`lightning_par.planner.inflight`, derived from torch's schedule
tables). ``total`` is what a rank holds when the last of them has run its forward; ``peak`` adds the largest working
set of one micro-batch: the loss's two fp32 gradients of the logits, a recomputed block with the gradients alive at
its last matmul's backward, or (autocast with recomputation) the weight copies of every checkpointed block, which
live until the forward's autocast region ends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lightning_par import axes
from lightning_par.parallel.activation_offload import MIN_BYTES as OFFLOAD_MIN_BYTES
from lightning_par.planner.inflight import inflight_microbatches, rank_blocks
from lightning_par.planner.layout import Layout, compute_bytes, stored_bytes
from lightning_par.planner.model import ModelDesc

PROFILES = ("megatron", "torch")
ATTENTION = ("sdpa", "eager")


@dataclasses.dataclass(frozen=True)
class Saved:
    """One tensor a block's forward creates and someone keeps until backward.

    Args:
        name: what it is (``"softmax output"``); ``nbytes``: its bytes on one GPU for one micro-batch.
        autograd: autograd keeps it (held without recomputation).
        selective: kept under ``recompute="selective"`` (the profile's policy).
        input: the block's input tensor itself (kept by full recomputation too).
        tail: kept only by ops after the block's last matmul (freed before that matmul's backward starts).
        last: the block's last matmul output (op-level checkpointing's replay stops before it unless a tail
            tensor must be recomputed).
    """

    name: str
    nbytes: float
    autograd: bool = True
    selective: bool = False
    input: bool = False
    tail: bool = False
    last: bool = False


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one pipeline rank, in bytes.

    Args:
        per_layer: one block's kept tensors for one micro-batch (mean over the rank's blocks).
        embedding_and_head: one micro-batch's kept tensors outside the blocks on this rank (embedding, final norm,
            head, loss).
        inflight_microbatches: micro-batches whose activations the rank holds at once, in units of one micro-batch
            through all its blocks.
        total: held when the last in-flight forward has run (what ``estimate`` adds to the model state).
        peak: ``total`` plus one micro-batch's backward working set.
        stage: the pipeline rank described.
    """

    per_layer: float
    embedding_and_head: float
    inflight_microbatches: float
    total: float
    peak: float
    stage: int = 0


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Shapes of one micro-batch on one GPU: ``T`` tokens in the residual stream, ``Tg`` tokens a linear reads."""

    T: float  # residual-stream tokens on this GPU (split by cp, and by tp under sequence parallelism)
    Tg: float  # tokens a linear layer's input holds (megatron: = T; torch: gathered back to b s / cp)
    Tt: float  # tokens of tensor-parallel activations (b s / cp), whose width is split by tp
    t: int
    b: int
    sq: float  # local queries (s / cp)
    sk: int  # keys each query attends to (s)


def _dims(layout: Layout, seq_len: int, profile: str) -> _Dims:
    b, t = layout.micro_batch_size, layout.tp
    tokens = b * seq_len / layout.cp
    stream = tokens / t if layout.sequence_parallel else tokens
    gathered = stream if profile == "megatron" else tokens  # torch keeps the all-gathered input of each region
    return _Dims(stream, gathered, tokens, t, b, seq_len / layout.cp, seq_len)


def _prec(layout: Layout, profile: str) -> tuple[int, int, bool]:
    """(compute bytes, residual-stream bytes, autocast) for the layout's precision."""
    if profile == "megatron":
        return 2, 2, False
    mixed = layout.precision in ("bf16-mixed", "16-mixed")
    return compute_bytes(layout.precision), stored_bytes(layout.precision), mixed


def block_tensors(
    desc: ModelDesc, layout: Layout, seq_len: int, profile: str = "torch", attention: str = "sdpa",
    dropout: Optional[float] = None,
) -> list[Saved]:  # fmt: skip
    """The per-op table: every tensor one block keeps for one micro-batch on one GPU (see the module docstring)."""
    _check(profile, attention)
    d = _dims(layout, seq_len, profile)
    p = (profile == "megatron") if dropout is None else dropout > 0  # the paper's GPT trains with dropout
    if profile == "megatron":
        return _megatron_block(desc, d, p)
    return _torch_block(desc, layout, d, attention, p)


def _megatron_block(desc: ModelDesc, d: _Dims, p: bool) -> list[Saved]:
    # Section 4.1 of the paper, term by term; "selective" recomputes the attention core (softmax, its dropout).
    T, Tg, Tt, t = d.T, d.Tg, d.Tt, d.t
    h, f = desc.hidden, desc.ffn / t
    q, kv, a = desc.heads * desc.head_dim / t, max(desc.kv_heads / t, 1) * desc.head_dim, desc.heads / t
    core = d.b * a * d.sq * d.sk
    out = [Saved("norm 1 input", 2 * T * h, selective=True, input=True), Saved("qkv input", 2 * Tg * h, selective=True),
           Saved("q", 2 * Tt * q, selective=True), Saved("k", 2 * Tt * kv, selective=True),
           Saved("softmax output", 2 * core), Saved("v", 2 * Tt * kv, selective=True)]  # fmt: skip
    if p:
        out += [Saved("softmax dropout mask", core), Saved("softmax dropout output", 2 * core)]
    out += [Saved("projection input", 2 * Tt * q, selective=True)]
    out += [Saved("attention dropout mask", T * h, selective=True)] if p else []
    out += [Saved("norm 2 input", 2 * T * h, selective=True), Saved("mlp input", 2 * Tg * h, selective=True)]
    k = desc.top_k if desc.experts else 1
    if desc.experts:  # the router in fp32 over this rank's tokens, then each token's input copied to k experts
        out += [Saved("router logits", 4 * Tg * desc.experts, selective=True),
                Saved("dispatched tokens", 2 * k * Tg * h, selective=True)]  # fmt: skip
    if desc.gated_mlp:  # fused SwiGLU: keeps gate and up outputs, recomputes silu
        out += [Saved("gate and up outputs", 4 * k * Tt * f, selective=True)]
    else:
        out += [Saved("gelu input", 2 * k * Tt * f, selective=True)]
    out += [Saved("fc2 input", 2 * k * Tt * f, selective=True)]
    out += [Saved("mlp dropout mask", T * h, selective=True, tail=True)] if p else []
    return out


def _torch_block(desc: ModelDesc, layout: Layout, d: _Dims, attention: str, p: bool) -> list[Saved]:
    # Measured op by op (module docstring); "selective" = the outputs of the suite's SAVE_OPS (mm, addmm, bmm,
    # sdpa); `_grouped_mm` (the HF experts' kernel) is not among them, so experts are recomputed.
    ec, es, mixed = _prec(layout, "torch")
    T, Tg, Tt, t = d.T, d.Tg, d.Tt, d.t
    h, f, a = desc.hidden, desc.ffn / t, desc.heads / t
    q, kv = desc.heads * desc.head_dim / t, max(desc.kv_heads / t, 1) * desc.head_dim
    gpt2 = desc.layernorm
    stat = 2 if layout.precision == "bf16-true" else 4  # norm statistics / normalized values (fp32 unless bf16)
    core = d.b * a * d.sq * d.sk

    def norm(n: int, linears: int) -> list[Saved]:
        # Llama's RMSNorm keeps its fp32 input (the fp32 stream itself, or a copy of a bf16 one), rsqrt and the
        # normalized values; GPT-2's LayerNorm its input, mean and rstd. A linear keeps its input; under autocast
        # each linear keeps its own bf16 copy.
        x = Saved(f"norm {n} input", (es if gpt2 else 4) * T * h, input=n == 1 and (gpt2 or es == 4))
        stats = [Saved("mean, rstd", 2 * stat * T)] if gpt2 else [Saved("rsqrt", 4 * T), Saved("normed", stat * T * h)]
        return [x, *stats, Saved("linear input", ec * Tg * h * (linears if mixed else 1))]

    eager = attention == "eager" or p
    out = norm(1, 1 if gpt2 else 3)
    if gpt2:
        out += [Saved("qkv projection", ec * Tt * (q + 2 * kv), autograd=not eager, selective=True)]
    else:
        out += [Saved("q projection", ec * Tt * q, autograd=False, selective=True),
                Saved("k projection", ec * Tt * kv, autograd=False, selective=True),
                Saved("v projection", ec * Tt * kv, autograd=not eager, selective=True)]  # fmt: skip
        if not eager:  # rotary outputs (or autocast's bf16 copies of them) are what attention keeps
            out += [Saved("q rotated", ec * Tt * q), Saved("k rotated", ec * Tt * kv)]
    if eager:  # batched-matmul copies of q, k and v (K and V repeated to every query head), s x s probabilities
        # sdpa's math path (taken for dropout on CPU) computes in fp32 whatever the inputs; Llama's eager softmax too.
        up = 4 if attention == "sdpa" else ec
        probs = 4 if attention == "sdpa" or not gpt2 or layout.precision != "bf16-true" else 2
        out += [Saved("q, k, v copies", 3 * up * Tt * q), Saved("scores", up * core, autograd=False, selective=True),
                Saved("softmax output", probs * core)]  # fmt: skip
        if p:
            out += [Saved("dropout mask", up * core), Saved("dropout output", up * core)]
        elif ec == 2 and (mixed or not gpt2):
            out += [Saved("probabilities cast", 2 * core)]
        out += [Saved("attention output", up * Tt * q, autograd=False, selective=True),
                Saved("attention output copy", ec * Tt * q)]  # fmt: skip
    else:
        out += [
            Saved("attention output", ec * Tt * q, selective=True),
            Saved("log-sum-exp", 4 * Tt * a, selective=True),
        ]
    out += [Saved("o projection", ec * Tt * h, autograd=False, selective=True)]
    out += [Saved("dropout mask", ec * T * h)] if p and gpt2 else []
    out += norm(2, 1 if gpt2 or desc.experts else 2)
    if desc.experts:
        E, k = desc.experts, desc.top_k
        # HF's grouped-GEMM experts: fp32 router probabilities, int64 top-k / sort / inverse indices, each token's
        # input copied to its k experts, their gate-up, silu and product, the outputs kept for the routing weights.
        out += [Saved("router logits", ec * Tg * E, autograd=False, selective=True),
                Saved("router probabilities", 4 * Tg * E), Saved("routing indices", Tg * (40 * k + 4) + 4 * E),
                Saved("dispatched tokens", ec * k * Tg * h), Saved("gate and up outputs", 2 * ec * k * Tg * f),
                Saved("silu, product", 2 * ec * k * Tg * f),
                Saved("expert outputs", ec * k * Tg * h, last=True)]  # fmt: skip
    elif gpt2:  # gelu_new in eager ops keeps x, tanh, 0.5x, 1 + tanh and its output
        out += [Saved("fc input", ec * Tt * f, selective=True), Saved("gelu internals", 4 * ec * Tt * f)]
        out += [Saved("fc2 output", ec * Tt * h, autograd=False, selective=True, last=True)]
        out += [Saved("dropout mask", ec * T * h, tail=True)] if p else []
    else:
        out += [Saved("gate, up outputs", 2 * ec * Tt * f, selective=True), Saved("silu, product", 2 * ec * Tt * f),
                Saved("down output", ec * Tt * h, autograd=False, selective=True, last=True)]  # fmt: skip
    if mixed and layout.zero_stage != 3:  # autocast's bf16 weight copies (FSDP2 gathers bf16 weights instead)
        out += [Saved("weight casts", 2 * _matrices(desc) / t)]
    return out


def _matrices(desc: ModelDesc) -> float:
    """One block's weight-matrix parameters (what autocast copies: biases are not kept)."""
    q, kv = desc.heads * desc.head_dim, desc.kv_heads * desc.head_dim
    return desc.hidden * (2 * q + 2 * kv) + (3 if desc.gated_mlp else 2) * desc.hidden * desc.ffn * (desc.experts or 1)


def ends_tensors(
    desc: ModelDesc, layout: Layout, seq_len: int, profile: str = "torch", *, embedding: bool = True,
    head: bool = True, dropout: Optional[float] = None,
) -> list[Saved]:  # fmt: skip
    """What one micro-batch keeps outside the blocks: the embedding's and (``head``) the final norm, head and loss."""
    _check(profile, "sdpa")
    d = _dims(layout, seq_len, profile)
    p = (profile == "megatron") if dropout is None else dropout > 0
    T, h, V = d.T, desc.hidden, desc.vocab
    out: list[Saved] = []
    if profile == "megatron":  # section 4.3: embedding dropout mask; final layernorm, head input, fp32 logits
        out += [Saved("token ids", 8 * T), Saved("embedding dropout mask", T * h)] if embedding else []
        if head:
            out += [Saved("final norm input", 2 * T * h), Saved("head input", 2 * d.Tg * h),
                    Saved("fp32 logits", 4 * d.Tt * V / d.t)]  # fmt: skip
        return out
    ec, es, mixed = _prec(layout, profile)
    if embedding and desc.layernorm:  # learned positions: the position ids; the embedding's dropout mask
        out += [Saved("position ids", 8 * d.sq)] + ([Saved("embedding dropout mask", es * d.Tt * h)] if p else [])
    elif embedding:  # rotary cos and sin tables, one per position
        out += [Saved("rotary cos, sin", 2 * (2 if layout.precision == "bf16-true" else 4) * d.sq * desc.head_dim)]
    if head:  # after the last block's output is gathered; tensor parallelism splits the blocks' linears only
        stat, Tt = (2 if layout.precision == "bf16-true" else 4), d.Tt
        stats = 2 * stat * Tt if desc.layernorm else 4 * Tt + stat * Tt * h
        out += [Saved("final norm", (es if desc.layernorm else 4) * Tt * h + stats), Saved("head input", ec * Tt * h),
                Saved("log-softmax output", 4 * d.Tt * V), Saved("loss", 8)]  # fmt: skip
        out += [Saved("head weight cast", 2 * V * h)] if mixed and layout.zero_stage != 3 else []
    return out


# ---- one rank: held tensors, then the backward's working set -----------------------------------------------------
def activation_bytes(
    desc: ModelDesc, layout: Layout, seq_len: int, profile: str = "torch", stage: Optional[int] = None, *,
    attention: str = "sdpa", dropout: Optional[float] = None, full_every: int = 1,
) -> ActivationBytes:  # fmt: skip
    """Activation memory of pipeline rank ``stage`` (``None``: the rank with the largest ``total``).

    Args:
        seq_len: tokens per sample (``Layout.micro_batch_size`` samples per micro-batch).
        profile: ``"megatron"`` or ``"torch"`` (module docstring).
        attention: the Hugging Face ``attn_implementation`` the ``"torch"`` profile models (``"sdpa"`` or
            ``"eager"``).
        dropout: dropout probability of the model's residual and attention dropouts (``ModelDesc`` does not carry
            it yet). ``None``: the paper's dropout under ``"megatron"``, none under ``"torch"``.
        full_every: under ``recompute="full"``, checkpoint every k-th block only (the suite's
            ``activation_checkpointing="selective"``; blocks 0, k, 2k, ...).
    """
    if stage is not None and not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} is not a pipeline rank of pp={layout.pp}; pass 0 .. {layout.pp - 1} or None")
    ranks = range(layout.pp) if stage is None else (stage,)
    return max((_rank(desc, layout, seq_len, profile, r, attention, dropout, full_every) for r in ranks),
               key=lambda a: a.total)  # fmt: skip


def _rank(
    desc: ModelDesc, layout: Layout, seq_len: int, profile: str, rank: int, attention: str,
    dropout: Optional[float], every: int,
) -> ActivationBytes:  # fmt: skip
    items = block_tensors(desc, layout, seq_len, profile, attention, dropout)
    d, (ec, es, mixed) = _dims(layout, seq_len, profile), _prec(layout, profile)
    blocks, has_emb, has_head, v = rank_blocks(layout, desc.layers, rank)
    m, pp = layout.microbatches, layout.pp
    inflight = inflight_microbatches(layout.pp_schedule, pp, m, rank, v) if pp > 1 else 1.0
    # The head's micro-batches run their backward right after their forward except under GPipe and looped BFS; the
    # embedding's first stage holds its warm-up's worth (Korthikanti et al. count p for the dropout mask).
    ends_in = inflight if pp > 1 and axes.SCHEDULES[layout.pp_schedule].all_forwards_first else 1.0
    emb_in = ends_in if ends_in > 1 else float(min(m or pp, pp))
    ends = {e: sum(x.nbytes for x in ends_tensors(desc, layout, seq_len, profile, embedding=e, head=not e,
                                                   dropout=dropout)) for e in (True, False)}  # fmt: skip
    emb, head = ends[True] * has_emb, ends[False] * has_head

    def total(pred: Any) -> float:
        return sum(x.nbytes for x in items if pred(x))

    stream_in = (2 if profile == "megatron" else es) * d.T * desc.hidden  # what full recomputation keeps
    none, tail = total(lambda x: x.autograd), any(x.tail for x in items)
    modes = [("full" if layout.recompute == "full" and i % every == 0 else
              "none" if layout.recompute == "full" else layout.recompute) for i in blocks]  # fmt: skip
    if layout.recompute == "offload":  # the trunk's first offload_blocks (all without it) hold theirs in host memory
        modes = ["offload" if layout.offload_blocks is None or i < layout.offload_blocks else "none" for i in blocks]
    held = {
        "none": none,
        "full": stream_in,
        "selective": total(lambda x: x.selective) + (0 if profile == "megatron" else stream_in),
        "offload": total(lambda x: x.autograd and x.nbytes < OFFLOAD_MIN_BYTES),  # what is too small to move
    }
    # The backward of a block: what recomputation brings back, minus what it frees, plus the gradients alive at
    # its last matmul's backward (the residual stream's gradient, a dropout branch's, that matmul's input and
    # weight gradients); a tied head's weight gradient waits for the embedding's.
    back = {"none": -total(lambda x: x.tail),
            "full": total(lambda x: x.autograd and not x.input and not x.tail),
            "selective": (total(lambda x: x.autograd and not x.selective) if profile == "megatron" else
                          total(lambda x: x.autograd and not x.selective and not x.input and not x.tail)
                          - total(lambda x: x.selective and not x.autograd and (tail or not x.last))),
            # its own tensors back, and the next block's prefetched beside them
            "offload": 2 * (none - held["offload"]) - total(lambda x: x.tail)}  # fmt: skip
    p = (profile == "megatron") if dropout is None else dropout > 0
    k, w = (desc.top_k, desc.experts) if desc.experts else (1, 1)
    f = desc.ffn / layout.tp
    grads = (2 if profile == "megatron" else es) * d.T * desc.hidden + (ec * d.T * desc.hidden if p or mixed else 0)
    if desc.experts and profile == "torch":  # the combine's backward: expanded, zeroed and scattered token grads
        grads += 3 * ec * k * d.Tg * desc.hidden
    else:
        grads += ec * k * d.Tt * f + ec * w * desc.hidden * f
    if profile == "torch" and desc.tied_embeddings and has_emb and has_head:
        grads += desc.vocab * desc.hidden * (2 if layout.precision == "bf16-true" else 4)
    per_block = [held[mode] for mode in modes]
    held_total = inflight * sum(per_block) + emb_in * emb + ends_in * head
    # The loss's forward (the fp32 logits beside the kept log-softmax; autocast's weight copies of every
    # checkpointed block live until its region ends) and backward (two fp32 gradients of the logits).
    logits = d.Tt * desc.vocab / (layout.tp if profile == "megatron" else 1) * has_head
    casts = sum(x.nbytes for x in items if x.name == "weight casts") * sum(mode in ("full", "selective")
                                                                           for mode in modes)  # fmt: skip
    work = max(8 * logits, 4 * logits + casts)
    if profile == "torch" and layout.recompute in ("full", "selective"):  # checkpoint keeps the blocks' arguments
        held_total += inflight * (8 * d.sq * (not desc.layernorm) + es * d.b * d.sq * d.sk * (attention == "eager"))
    later = head
    for mode, kept in zip(reversed(modes), reversed(per_block)):
        work = max(work, back[mode] + grads - later)
        later += kept
    n = max(len(blocks), 1)
    return ActivationBytes(sum(per_block) / n, emb + head, inflight, held_total, held_total + work, rank)


def _check(profile: str, attention: str) -> None:
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is unknown; choose one of {PROFILES}")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is unknown; choose one of {ATTENTION} (HF attn_implementation)")
