"""Train reference models under a strategy and dump what tests compare. Run under torchrun or as one process.

``python tests/_worker.py SPEC.json``: SPEC has ``out`` (a .pt path written by global rank 0) and ``jobs``, a list
of dicts (see `run_job`). All jobs run in this one process group, since a spawn costs seconds here. The process
ends with barrier, destroy_process_group and ``os._exit`` (avoids exit-time aborts, docs/testing.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_par  # noqa: E402  (registers the strategy names)
from lightning_par.callbacks import ParallelismMonitor  # noqa: E402
from lightning_par.checkpoint import full_tensor  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT, Llama, MoEGPT  # noqa: E402
from lightning_par.parallel.grad_norm import global_grad_norm  # noqa: E402
from lightning_par.strategies import make_strategy  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class SGDGPT(GPT):
    """The GPT with SGD + momentum: parameter updates are linear in the gradients, unlike Adam's (see tests)."""

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


class ForeachSGDGPT(SGDGPT):
    """SGDGPT with ``foreach=True``: torch's multi-tensor kernels, CUDA's default, which refuse a list that mixes
    DTensors and plain tensors (what tp at ZeRO-0 handed them before `zero.local_views`)."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        for group in optimizer.param_groups:
            group["foreach"] = True
        return optimizer


class NoLogGPT(GPT):
    """The GPT whose training_step does not call self.log (Lightning's single-device strategy cannot fit a
    torch.compile'd module that does: docs/strategies.md, "torch.compile")."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return self._loss(self(x), y)


class FailingGPT(GPT):
    """Raises in training_step on global rank 1 at batch 1: a user bug on one rank only."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("injected failure in training_step on rank 1")
        return super().training_step(batch, batch_idx)


class DropoutGPT(GPT):
    """The GPT with dropout 0.1, so the losses depend on the torch RNG; each step also draws from Python's `random`
    and NumPy's global generator (recorded in `draws`), so a resume must restore those too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(dropout=0.1, **kwargs)
        self.draws: list[tuple[float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.draws.append((random.random(), float(np.random.rand())))
        return super().training_step(batch, batch_idx)


class SGDMoEGPT(MoEGPT):
    """The MoE-GPT with SGD + momentum (updates linear in the gradients; see SGDGPT)."""

    configure_optimizers = SGDGPT.configure_optimizers


class HFMixtralLM(L.LightningModule):
    """A LightningModule around a Hugging Face ``MixtralForCausalLM`` built from a tiny config (no download);
    the strategy must shard its experts without changes to it. SGD: updates linear in the gradients."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.model = self.build(layers)

    @staticmethod
    def build(layers: int = 2) -> Any:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=False,
                               attn_implementation="eager")  # fmt: skip
        return MixtralForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class HFMixtralDeferred(HFMixtralLM):
    """`HFMixtralLM` built in ``configure_model()`` (on the meta device under lightning_par)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = self.build()


class _Residual(torch.nn.Module):
    """x + mlp(norm(x)), with an optional extra argument (a mask-like scale) the trunk passes to every block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + (h if scale is None else h * scale)


class _TinyLM(L.LightningModule):
    """A user model that is not one of ours: embedding, a trunk, head; logs train_loss and a second value."""

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self._loss(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("tokens", float(x.numel()), reduce_fx="sum")
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(*batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class AdafactorGPT(GPT):
    """The GPT with torch's Adafactor: second moments factored over each weight's rows and columns."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


class _Mix(torch.nn.Module):
    """x + W2 gelu(W1 x), no biases: every parameter of `MuonLM` is a matrix, as torch's Muon requires."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MuonLM(_TinyLM):
    """A user model trained with torch's Muon, which orthogonalizes each whole weight matrix (not element-wise)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList([_Mix(32) for _ in range(2)])
        self.head = torch.nn.Linear(32, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def configure_optimizers(self) -> Any:
        return torch.optim.Muon(self.parameters(), lr=0.02)


_MOE = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, n_experts=4, top_k=2)


class SeqTrunkLM(_TinyLM):
    """Trunk = an nn.Sequential of blocks called as one module (``self.trunk(h)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.trunk = torch.nn.Sequential(*[_Residual(32) for _ in range(4)])
        self.head = torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.emb(x)))


class DictTrunkLM(_TinyLM):
    """Trunk = an nn.ModuleDict iterated by key, each block taking an extra argument computed before the trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleDict({f"b{i}": _Residual(32) for i in range(4)})
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scale = torch.linspace(0.5, 1.0, x.shape[1], device=x.device)[None, :, None]  # a side input
        for block in self.blocks.values():
            h = block(h, scale)
        return self.head(self.norm(h))


class SkipLM(_TinyLM):
    """Six blocks whose outputs also reach later blocks or the head other than through the hidden state, as user
    models write them (tests/test_pipeline_units.py, tests/test_pipeline_families.py). ``mode``:

    - ``unet``: blocks 0-2 push their outputs on a list, blocks 3-5 each add one back before running (no cut works);
    - ``groups``: in each group of three blocks, the first block's output is added to the third block's input (only
      the cut between the groups, before block 3, works);
    - ``x0``: the embedding's output is added to every later block's input (modded-nanoGPT's value residual kind);
    - ``outside``: the residual is added around each block, outside it (``h = h + block(h)``);
    - ``late_read``: block 3's output is added to the last block's before the head (cuts up to block 3 work).
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList([_Residual(32) for _ in range(6)])
        self.head = torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x0 = self.emb(x)
        skips: list[torch.Tensor] = []
        late = h
        for i, block in enumerate(self.blocks):
            if self.mode == "outside":
                h = h + block(h)
                continue
            if (self.mode == "unet" and i >= 3) or (self.mode == "groups" and i % 3 == 2):
                h = h + skips.pop()
            if self.mode == "x0" and i > 0:
                h = h + x0
            h = block(h)
            if (self.mode == "unet" and i < 3) or (self.mode == "groups" and i % 3 == 0):
                skips.append(h)
            late = h if i == 3 else late
        return self.head(h + late if self.mode == "late_read" else h)

    def configure_optimizers(self) -> Any:
        # The skips double the activations' scale: at _TinyLM's lr 0.5 the summation order of microbatches moves a
        # few head weights by 6e-7 in 3 steps, past the 1e-7 absolute bound every SGD parity check uses.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ProbeGPT(GPT):
    """A GPT whose code reads weights where ZeRO-1/2's deferred all-gather may still be running
    (tests/test_zero_prefetch.py): ``training_step`` reads the last block's weight before the forward, and a step
    post-hook of its optimizer sums every weight after each step."""

    def __init__(self, read_early: bool = False, post_hook: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.read_early, self.post_hook = read_early, post_hook
        self.early: list[float] = []
        self.after_step: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.read_early:
            self.early.append(float(self.transformer.h[-1].mlp.c_fc.weight.double().sum()))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        conf = super().configure_optimizers()  # {"optimizer": ..., "lr_scheduler": ...}
        if self.post_hook:
            conf["optimizer"].register_step_post_hook(lambda *_: self.after_step.append(_weight_sum(self)))
        return conf


def _weight_sum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


class EMA(L.Callback):
    """An exponential moving average of the weights, updated between the optimizer step and the next forward."""

    def __init__(self) -> None:
        self.avg: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for n, p in pl_module.named_parameters():
            w = p.detach().float().cpu()
            self.avg[n] = w.clone() if n not in self.avg else 0.5 * self.avg[n] + 0.5 * w


_PROBE = {"vocab_size": 258, "block_size": 34, "n_layer": 3, "n_head": 4, "n_embd": 36, "lr": 3e-3}
MODELS = {
    # Uneven shards, a tied head: the deferred all-gather (tests/test_zero_prefetch.py).
    "gpt_quiet": lambda: ProbeGPT(**_PROBE, tie_weights=True),
    "gpt_read_early": lambda: ProbeGPT(read_early=True, **_PROBE, tie_weights=True),
    "gpt_post_hook": lambda: ProbeGPT(post_hook=True, **_PROBE, tie_weights=True),
    "gpt": lambda: GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3),
    "llama": lambda: Llama(vocab_size=256, max_seq_len=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_hidden=64, lr=3e-3),
    "gpt_nolog": lambda: NoLogGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3),
    "gpt_fail": lambda: FailingGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "gpt_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "gpt_sgd_foreach": lambda: ForeachSGDGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "gpt_dropout": lambda: DropoutGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, lr=3e-3),
    # Wide enough that DeepSpeed's NVMe offload really swaps (it keeps partitions under 1 MiB in memory).
    "gpt_wide": lambda: GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=192, lr=3e-3),
    # Dims 258, 34 not divisible by 4: uneven shards (ceil(d0/n) rows, the last rank short), as real vocabularies.
    "gpt_uneven": lambda: GPT(vocab_size=258, block_size=34, n_layer=2, n_head=4, n_embd=36, lr=3e-3),
    "hf_llama": lambda: _hf_models().HFLlama(),
    "hf_llama_4": lambda: _hf_models().HFLlama(layers=4),  # four blocks, for pp 4
    "hf_llama_sdpa": lambda: _hf_models().HFLlama(attn="sdpa"),  # Hugging Face's SDPA path (context parallel)
    "hf_llama_configure_model": lambda: _hf_models().HFLlamaConfigured(),  # built in configure_model()
    "gpt_3heads": lambda: GPT(vocab_size=256, block_size=32, n_layer=2, n_head=3, n_embd=24),  # tp=2 cannot split
    # MoE-GPT: dropless, and with capacity factor 0.75 (a quarter of the assignments or more are dropped).
    "moe_gpt": lambda: MoEGPT(**_MOE, lr=3e-3),
    "moe_gpt_sgd": lambda: SGDMoEGPT(**_MOE),
    "moe_gpt_cap_sgd": lambda: SGDMoEGPT(**_MOE, capacity_factor=0.75),
    # Aux and z-loss weights large enough that a per-rank mean where one over the whole samples is due shows at 1e-5.
    "moe_gpt_cap_aux_sgd": lambda: SGDMoEGPT(**_MOE, capacity_factor=0.75, aux_loss_coef=1.0, z_loss_coef=0.1),
    "moe_gpt_aux_sgd": lambda: SGDMoEGPT(**_MOE, aux_loss_coef=1.0, z_loss_coef=0.1),
    "moe_gpt_3experts": lambda: MoEGPT(**{**_MOE, "n_experts": 3}),
    "moe_gpt_noaux": lambda: MoEGPT(**_MOE, lr=3e-3, aux_loss_coef=0.0, z_loss_coef=0.0),
    "moe_gpt_cap_sgd_noaux": lambda: SGDMoEGPT(**_MOE, capacity_factor=0.75, aux_loss_coef=0.0, z_loss_coef=0.0),
    "moe_gpt_cap_sgd_4": lambda: SGDMoEGPT(**{**_MOE, "n_layer": 4}, capacity_factor=0.75),  # for two stages a rank
    "hf_mixtral": HFMixtralLM,
    "hf_mixtral_deferred": lambda: HFMixtralDeferred(),  # built in configure_model()
    "hf_mixtral_4": lambda: HFMixtralLM(layers=4),  # four blocks, for pp 4
    "hf_llama_deferred": lambda: _hf_models().HFLlamaDeferred(),
    "hf_qwen3": lambda: _hf_models().HFQwen3(),  # dense, per-head q/k norms
    # MoE families we did not write (tests/_families_moe.py): experts recognised by structure.
    "hf_qwen2_moe": lambda: _families_moe().HFQwen2MoE(),
    "hf_qwen3_moe": lambda: _families_moe().HFQwen3MoE(),
    "hf_olmoe": lambda: _families_moe().HFOlmoe(),
    "hf_mixtral_aux": lambda: _families_moe().HFMixtralAux(),  # output_router_logits=True, aux term in the loss
    "hf_deepseek_v3": lambda: _families_moe().HFDeepseekV3(),
    "hf_gpt_oss": lambda: _families_moe().HFGptOss(),
    "hf_mixtral_sdpa_aux": lambda: _families_moe().HFMixtralSdpaAux(),  # SDPA + its aux loss (cp x ep)
    "user_moe_list": lambda: _families_moe().UserMoEList(),
    "user_moe_uneven": lambda: _families_moe().UserMoEList(uneven=True),  # refused under ep > 1
    # Four blocks, for pp 4 (DeepSeek-V3: one dense block, three MoE blocks).
    "hf_deepseek_v3_4": lambda: _families_moe().HFDeepseekV3(layers=4),
    "hf_qwen2_moe_4": lambda: _families_moe().HFQwen2MoE(layers=4),
    "hf_qwen3_moe_4": lambda: _families_moe().HFQwen3MoE(layers=4),
    "hf_mixtral_sdpa_aux_4": lambda: _families_moe().HFMixtralSdpaAux(layers=4),  # pp 2 x cp 2, interleaved
    "hf_olmoe_4": lambda: _families_moe().HFOlmoe(layers=4),
    # output_router_logits=False: no load-balancing term (tests/test_pipeline_aux.py checks that it counts).
    "hf_qwen2_moe_noaux": lambda: _families_moe().HFQwen2MoE(router_logits=False),
    "user_moe_list_4": lambda: _families_moe().UserMoEList(layers=4),
    # Multi-head latent attention with a low-rank query too (q_a_proj -> q_a_layernorm -> q_b_proj).
    "hf_deepseek_v3_qlora": lambda: _families_moe().HFDeepseekV3(q_lora_rank=16),
    # Blocks of two structures (attention, feed-forward, ...), as x-transformers lays out its layers.
    "user_alternating": lambda: _tp_mixed_models().AlternatingLM(),
    # Four blocks: room for 2 stages x 2 virtual stages per rank (interleaved and V schedules).
    "gpt4": lambda: GPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32, lr=3e-3),
    "llama4": lambda: Llama(vocab_size=256, max_seq_len=32, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                            ffn_hidden=64, lr=3e-3),
    "gpt4_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32),
    "gpt_adafactor": lambda: AdafactorGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "muon_lm": MuonLM,
    "seq_trunk": lambda: SeqTrunkLM(),
    "skip_groups": lambda: SkipLM("groups"),  # skip connections inside groups of blocks: one cut keeps the values
    "skip_unet": lambda: SkipLM("unet"),  # skip connections across every cut: pipelines refuse it
    "dict_trunk": lambda: DictTrunkLM(),
    "gpt4_tied_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32, tie_weights=True),
    # Families we did not write (tests/_families.py), each a plain user LightningModule with SGD + momentum.
    "litgpt_pythia": lambda: _families().LitGPTPythia(),
    "litgpt_llama": lambda: _families().LitGPTLlama(),
    "xt_decoder": lambda: _families().XTransformersDecoder(),  # None entries in its ModuleLists
    "hf_gpt2": lambda: _families().HFGPT2(),
    "hf_qwen2_tied": lambda: _families().HFQwen2Tied(),
    "hf_vit": lambda: _families().HFViT(),
    "hf_bert": lambda: _families().HFBert(),
    "grouped_lm": lambda: _families().GroupedLM(),  # fused qkv interleaved per k/v group
    "nano_lm": lambda: _families().NanoLM(),  # sizes its split by x.size(-1): refused under tp
}  # fmt: skip


def _families_moe() -> Any:
    import _families_moe  # test-only: needs transformers

    return _families_moe


def _tp_mixed_models() -> Any:
    import _tp_mixed_models  # test-only

    return _tp_mixed_models


def _families() -> Any:
    import _families  # test-only: needs litgpt and transformers

    return _families


def _hf_models() -> Any:
    import _hf_models  # test-only: needs transformers

    return _hf_models


def _local_bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _auto_choice(strategy: Any) -> dict[str, Any] | None:
    from lightning_par.strategies.auto import AutoParallelStrategy, explain

    if not isinstance(strategy, AutoParallelStrategy) or strategy.ranking is None:
        return None
    return {
        "chosen": strategy.chosen,
        "top": explain(strategy.ranking),
        "n_feasible": len(strategy.ranking.feasible),
        "ruled_out": [why for _, why in strategy.ranking.infeasible],
    }


class Recorder(L.Callback):
    """Per-step loss (as logged, i.e. reduced over data-parallel ranks), grad norm and memory."""

    def __init__(self, fail_at_step: int | None = None, fail_rank: int = 1) -> None:
        self.losses: list[float] = []
        self.local_losses: list[float] = []
        self.grad_norms: list[float] = []
        self.batch_heads: list[list[int]] = []
        self.mem: dict[str, int] = {}
        self.fail_at_step, self.fail_rank = fail_at_step, fail_rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.fail_at_step is not None and batch_idx == self.fail_at_step and trainer.global_rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {trainer.global_rank} at batch {batch_idx}")

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        # What backward leaves on the model's own parameters: full gradients (ZeRO 0/1), none (ZeRO-2 reduced and
        # freed them bucket by bucket), or gradient shards (ZeRO-3, whose parameters are shards).
        held = _local_bytes(p.grad for p in pl_module.parameters())
        self.mem["model_grads_after_backward"] = max(self.mem.get("model_grads_after_backward", 0), held)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # Under a pipeline each rank holds its stages' gradients only: the norm sums over the pipeline group.
        groups = getattr(getattr(trainer.strategy, "precision_plugin", None), "norm_groups", ())
        self.grad_norms.append(float(global_grad_norm(params, groups)))
        # The gradients the optimizer steps on: full (ZeRO-0) or this rank's shards (ZeRO 1-3).
        self.mem["grads"] = max(self.mem.get("grads", 0), _local_bytes(p.grad for p in params))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch_heads.append(batch[0][:, 0].tolist())
        self.local_losses.append(float(outputs["loss"]))
        self.losses.append(float(trainer.callback_metrics.get("train_loss", outputs["loss"])))  # (NoLogGPT: its own)
        self.mem["params"] = _local_bytes(pl_module.parameters())
        self.mem["optim"] = _local_bytes(
            v for opt in trainer.optimizers for s in opt.state.values() for k, v in s.items() if k != "step"
        )


class _QuietRecorder(Recorder):
    """A Recorder in no hook (``quiet`` jobs): it is not in the trainer's callbacks, only in the result's code."""


def _prefetch_stats(strategy: Any) -> dict[str, Any] | None:
    """ZeRO-1/2's deferred all-gather: how often it was deferred and where it was waited for, and the units."""
    zero = getattr(getattr(strategy, "parallel_run", None), "zero", None)
    prefetch = getattr(zero, "prefetch", None)
    if prefetch is None:
        return None
    group = prefetch.group
    return {**prefetch.stats, "enabled": prefetch.enabled, "units": len(prefetch.units),
            "default_group": group is dist.group.WORLD, "group_ranks": dist.get_process_group_ranks(group)}  # fmt: skip


class RankSeed(L.Callback):
    """Gives every rank its own RNG streams (Lightning's strategy setup seeds all ranks alike), once the process
    group exists; a resume then restores each rank's saved streams at train start."""

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        torch.manual_seed(1000 + trainer.global_rank)
        random.seed(2000 + trainer.global_rank)
        np.random.seed(3000 + trainer.global_rank)


class RoutingRecorder(L.Callback):
    """Per step and MoE layer: router logits, chosen experts and kept (within capacity) flags of the step's tokens,
    in global batch order (rank r's local sample i is global sample i * dp + r under the DistributedSampler)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self._logits: list[torch.Tensor] = []
        self.rows = [0]

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._tp = getattr(getattr(trainer.strategy, "config", None), "tp", 1)  # tp ranks hold the same samples
        for moe in pl_module._moe_layers():
            # Rows this rank's experts compute (after the dispatch hooks: under tp x ep, this rank's share).
            moe.experts.register_forward_pre_hook(self._count_rows)
            moe.router.register_forward_hook(lambda _m, _a, out: self._logits.append(out.detach().float().clone()))

    def _count_rows(self, module: torch.nn.Module, args: Any) -> None:
        self.rows[0] += len(args[0])

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._logits.clear()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        b = batch[0].shape[0]
        step = {}
        for i, moe in enumerate(pl_module._moe_layers()):
            for key, t in (("logits", self._logits[i]), ("expert", moe.stats["expert_index"]),
                           ("kept", moe.stats["kept"])):  # fmt: skip
                step[f"{i}.{key}"] = t.reshape(b, -1, t.shape[-1]).cpu().clone()
            step[f"{i}.tokens_per_expert"] = moe.stats["tokens_per_expert"].cpu().clone()
        self.steps.append(step)

    def global_order(self) -> list[dict[str, torch.Tensor]]:
        if not dist.is_initialized():
            return self.steps
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.steps)
        parts = parts[:: getattr(self, "_tp", 1)]  # one rank per tp group (tp innermost): the dp ranks' samples
        out = []
        for k, step in enumerate(parts[0]):
            merged = {}
            for key, t in step.items():
                if key.endswith("tokens_per_expert"):
                    merged[key] = t
                    continue
                # Interleave samples: global i*dp + r <- dp rank r's i (no pp under moe tests).
                stacked = torch.stack([p[k][key] for p in parts], dim=1)  # [b, dp, ...]
                merged[key] = stacked.flatten(0, 1)
            out.append(merged)
        return out


def _gather_experts(trainer: L.Trainer, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Replace the local expert shards in ``params`` by the full stacked weights (all-gathered over ep); add the
    ``nn.ModuleList`` experts other ep ranks hold, under their names."""
    experts = getattr(getattr(trainer.strategy, "parallel_run", None), "experts", None)
    if experts is None or experts.mesh is None:
        return
    group = experts.mesh.ep.get_group()
    names = {p: n for n, p in model.named_parameters()}
    whole = {names[p]: p.detach().float().cpu() for n, p in experts.names.items() if n not in experts._full_shapes}
    held: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, whole, group=group)
    for part in held:
        params.update(part)
    for n, p in experts.names.items():
        if n not in experts._full_shapes:
            continue
        local = p.detach().contiguous()
        if n in experts.tp_dims:  # etp = tp: the hidden width split over tp first
            slices = [torch.empty_like(local) for _ in range(dist.get_world_size(experts.tp_group))]
            dist.all_gather(slices, local, group=experts.tp_group)
            local = torch.cat(slices, dim=experts.tp_dims[n]).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        params[names[p]] = torch.cat(parts).float().cpu()


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call; Lightning calls loggers on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


# Steps ended so far and whether training is over, for writes that wait for a step (`_patch_checkpoint_writes`).
_STEP_ENDS = threading.Condition()
_STEPS: dict[str, Any] = {"ended": 0, "over": False, "saves": []}  # saves: steps ended at each save call


class CheckpointRecorder(L.Callback):
    """The step a run starts at (after any resume), full parameters after each step, and how many steps ended
    while an asynchronous save was being written."""

    def __init__(self, record_params: bool) -> None:
        self.start_step = -1
        self.record_params = record_params
        self.step_params: dict[int, dict[str, torch.Tensor]] = {}
        self.steps_while_writing = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs before ModelCheckpoint's hook (Lightning puts checkpoint callbacks last): a save in flight now is one
        # started at an earlier step.
        if getattr(trainer.strategy, "checkpoint_in_flight", None) is not None:
            self.steps_while_writing += 1
        with _STEP_ENDS:  # after the count: a write waiting for this step is still in flight above
            _STEPS["ended"] += 1
            _STEPS["over"] = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
            _STEP_ENDS.notify_all()
        if self.record_params:
            self.step_params[trainer.global_step] = _full_params(pl_module)


class OptimizerRecorder(L.Callback):
    """The first optimizer's state when training starts (after any resume), full tensors keyed by parameter name."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        opt = trainer.optimizers[0]
        if hasattr(trainer.strategy, "engine"):
            self.state = _deepspeed_optimizer_state(trainer.strategy, opt)
            return
        if isinstance(trainer.strategy, lightning_par.ParallelStrategy):
            named = trainer.strategy.optimizer_state(opt)["state"]  # sharded tensors as DTensors
        else:
            names = {p: n for n, p in pl_module.named_parameters()}
            named = {names[p]: s for p, s in opt.state.items()}
        # full_tensor() is a collective: every rank walks the same names in the same order.
        self.state = {
            name: {k: full_tensor(v).detach().float().cpu().clone() for k, v in st.items()}
            for name, st in named.items()
        }  # fmt: skip


def _full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # set on every rank (None off its partition)
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p).reshape(getattr(p, "ds_shape", p.shape))  # DeepSpeed's fp32 master
        else:
            t = full_tensor(p)
        out[name] = t.detach().float().cpu().clone()
    return out


def _ds_batch(strategy: Any) -> Optional[tuple[int, int, int]]:
    """DeepSpeed's (micro batch per rank, train batch size, throughput timer's batch size), or ``None``."""
    if not isinstance(strategy, lightning_par.DeepSpeedParallelStrategy) or strategy._engine is None:
        return None
    engine = strategy.engine
    return engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(), engine.tput_timer.batch_size


def _deepspeed_optimizer_state(strategy: Any, opt: Any) -> dict[str, dict[str, Any]]:
    # Each rank keeps a round-robin share of the names (lightning_par.parallel.deepspeed.state): merge them.
    mine = {
        n: {k: v.detach().float().cpu() for k, v in st.items()}
        for n, st in strategy.optimizer_state(opt)["state"].items()
    }
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    return {n: st for share in shares for n, st in share.items()}


def _first_attempt() -> bool:
    # torchrun counts restarts of the whole job (--max-restarts); 0 or unset on the first attempt.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _sigkill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class SigKill(L.Callback):
    """SIGKILLs global rank ``rank`` when global step ``step`` is about to start, on torchrun's first attempt only."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and _first_attempt():
            _sigkill()


@contextmanager
def _slow_staging(pause: float) -> Iterator[None]:
    # The background copy of parameters and optimizer state (async_save.py) sleeps first: the optimizer step after a
    # save must wait for it, or the checkpoint would hold that step's update.
    from lightning_par.checkpoint.async_save import _BufferStager

    original = _BufferStager._copy_later

    def copy_later(copies: Any) -> None:
        time.sleep(pause)
        original(copies)

    _BufferStager._copy_later = staticmethod(copy_later)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _BufferStager._copy_later = staticmethod(original)  # type: ignore[method-assign]


@contextmanager
def _patch_checkpoint_writes(job: dict[str, Any]) -> Iterator[None]:
    """Test hooks in DCP's file writer (the data files of every save, sync or async, in whichever thread):
    ``write_after_next_step``: a write in a background thread (an asynchronous save) starts only once training has
    ended one more step (or is over), so that training provably runs on while a checkpoint is written, whatever the
    machine's speed; ``sigkill_in_save: {"nth": n, "rank": r}`` SIGKILLs rank r right after its data file of the n-th
    save was written (before the index), on torchrun's first attempt only."""
    slow, kill = job.get("write_after_next_step"), job.get("sigkill_in_save")
    rank = int(os.environ.get("RANK", "0"))
    if job.get("slow_staging_s"):
        with _slow_staging(float(job["slow_staging_s"])), _patch_checkpoint_writes({**job, "slow_staging_s": 0}):
            yield
        return
    if not slow and not (kill and kill["rank"] == rank and _first_attempt()):
        yield
        return
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data
    calls = [0]

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if slow and threading.current_thread() is not threading.main_thread():
            # Until the step after the one that saved (not after this thread started), the end of training, or
            # another save, which waits for this one (Lightning saves step=N.ckpt and last.ckpt at one step end).
            with _STEP_ENDS:
                at_save = _STEPS["saves"].pop(0) if _STEPS["saves"] else _STEPS["ended"]
                _STEP_ENDS.wait_for(lambda: _STEPS["ended"] > at_save or _STEPS["over"] or _STEPS["saves"], timeout=120)
        written = original(self, plan, planner)
        calls[0] += 1
        if kill and calls[0] == kill["nth"]:
            written.wait()
            _sigkill()
        return written

    _FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        _FileSystemWriter.write_data = original  # type: ignore[method-assign]


@contextmanager
def _recorded_warnings(into: list[Any], record: bool) -> Iterator[None]:
    if not record:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    into.extend(caught)


@contextlib.contextmanager
def _counted_reduce_scatters(into: list[int], record: bool) -> Iterator[None]:
    """Count the reduce-scatters FSDP2 issues (it calls ``torch.distributed.reduce_scatter_single``); each call
    still runs the real collective."""
    if not record:
        yield
        return
    real = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        into.append(1)
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        yield
    finally:
        dist.reduce_scatter_single = real


def _fsdp_groups(strategy: Any) -> int:
    """FSDP2 parameter groups (one reduce-scatter each per reduction) on this rank, pipeline stages included."""
    from torch.distributed.fsdp import FSDPModule

    run = strategy.parallel_run
    roots = run.pipeline.model.stage_modules() if run.pipeline is not None else [strategy.model]
    units = {id(m): m for r in roots for m in r.modules() if isinstance(m, FSDPModule)}
    return sum(m._get_fsdp_state()._fsdp_param_group is not None for m in units.values())  # type: ignore[operator]


def _checkpoint_callbacks(job: dict[str, Any]) -> list[L.Callback]:
    if not job.get("ckpt_dir"):
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    if job.get("ckpt_every_n_steps"):
        # Keep the newest `save_top_k` by step (and last.ckpt with save_last), written after every n-th step.
        steps = [ModelCheckpoint(dirpath=job["ckpt_dir"], filename="{step}", monitor="step", mode="max",
                                 every_n_train_steps=job["ckpt_every_n_steps"], save_top_k=job.get("save_top_k", -1),
                                 save_last=job.get("save_last", False))]  # fmt: skip
        if job.get("ckpt_epoch_end_dir"):  # also one per epoch, written at the epoch's end (on_train_epoch_end)
            steps.append(ModelCheckpoint(dirpath=job["ckpt_epoch_end_dir"], filename="{epoch}", save_top_k=-1,
                                         every_n_epochs=1, save_on_train_epoch_end=True))  # fmt: skip
        return steps

    # One checkpoint per epoch, written at the epoch's end so the loop state says "epoch finished".
    return [ModelCheckpoint(dirpath=job["ckpt_dir"], filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                            save_on_train_epoch_end=True)]  # fmt: skip


def _ds_gathered(params: list[Any]) -> Any:
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


class InitRecorder(L.Callback):
    """The full parameters and persistent buffers right after set-up (before any step), merged over pipeline stages."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from lightning_par.checkpoint.strided import full_tensor

        # DeepSpeed ZeRO-3 holds partitions only: gather the whole model for the recording (a test-sized model).
        params = [p for p in pl_module.parameters() if hasattr(p, "ds_id")]
        gathered = _ds_gathered(params) if params else contextlib.nullcontext()
        with gathered:
            state = {k: full_tensor(v).detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        if getattr(getattr(trainer.strategy, "config", None), "pp", 1) > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, state)
            state = {k: v for d in every for k, v in d.items()}
        self.state = state


def _asdict(report: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(report) if report is not None else None


def _gathered_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One fit. Keys: model, strategy (name or kwargs for ParallelStrategy), precision, steps, global_batch, seq_len,
    accumulate, clip, seed, devices, num_nodes, save (path), resume (path), fail_at_step, validate, predict,
    record_optim (the optimizer state at train start, after a resume), expect_error (return the fit's exception
    as ``error`` instead of failing the spawn), record_warnings (return the fit's warnings as ``warnings``)."""
    # Checkpoint options: ckpt_every_n_steps, save_top_k, save_last (see _checkpoint_callbacks); resume "last"
    # (Lightning's) or "latest" (lightning_par.checkpoint.latest(ckpt_dir)); sigkill_at_step {"step", "rank"};
    # sigkill_in_save {"nth", "rank"}; write_after_next_step; slow_staging_s; record_step_params; limit_val_batches;
    # ckpt_epoch_end_dir (also an epoch-end checkpoint per epoch there); rank_seed (per-rank RNG seeds).
    # Under torchrun WORLD_SIZE is set; when Lightning starts the processes itself the job states it.
    if job.get("simulate"):  # local SGD in one process (tests/_local_sgd_sim.py)
        from _local_sgd_sim import simulate

        return simulate(job, MODELS[job.get("model", "gpt")])
    world = job.get("world") or int(os.environ.get("WORLD_SIZE", "1"))
    with _STEP_ENDS:
        _STEPS.update(ended=0, over=False, saves=[])
    L.seed_everything(job.get("seed", 0), verbose=False)
    model_cls = MODELS[job.get("model", "gpt")]
    strategy: Any = job.get("strategy", "auto")
    if isinstance(strategy, dict):
        strategy = make_strategy(**strategy)
    dp = job.get("dp", world)
    accumulate = job.get("accumulate", 1)
    steps = job.get("steps", 3)
    global_batch = job.get("global_batch", 8)
    samples = global_batch * accumulate * job.get("epoch_steps", steps)
    seq_len = job.get("seq_len", 32)
    data: L.LightningDataModule = ByteTextDataModule(
        seq_len=seq_len, batch_size=global_batch // dp, num_samples=samples, seed=0
    )
    if job.get("stream"):  # an iterable training dataset (tests/_streams.py): stream, stream_samples, workers
        from _streams import StreamData

        data = StreamData(job["stream"], seq_len, global_batch // dp, job.get("stream_samples", samples),
                          job.get("workers", 0), job.get("stream_dir", "."))  # fmt: skip
    elif world == 1 and job.get("strategy", "auto") == "auto":
        # (A lightning_par strategy in one process gets the distributed sampler itself, as below.)
        # Lightning always shuffles a distributed training loader (DistributedSampler(shuffle=True, seed=0)); at
        # step k the ranks together read perm[k*B:(k+1)*B] of that permutation, so the one-process reference
        # reads the same permutation in order and sees the same global batches.
        data.setup()
        order = data._train.order
        data._train.order = order[torch.randperm(len(order), generator=torch.Generator().manual_seed(0))]
    recorder = Recorder(job.get("fail_at_step"))
    memory_logger = MemoryLogger() if job.get("memory_logger") else None
    optim_recorder = OptimizerRecorder()
    ckpt_recorder = CheckpointRecorder(bool(job.get("record_step_params")))
    routing = RoutingRecorder()
    extra: list[L.Callback] = [ckpt_recorder, *([optim_recorder] if job.get("record_optim") else [])]
    ema = EMA() if job.get("ema") else None
    if job.get("quiet"):  # no callback of ours in the batch hooks: losses come from the logger
        recorder, memory_logger, extra = _QuietRecorder(), MemoryLogger(), []
    if ema is not None:
        extra.append(ema)
    monitor = ParallelismMonitor(pictures_every_n_steps=1) if job.get("expert_load") else None
    if monitor is not None:
        extra.append(monitor)
    if job.get("record_init"):
        extra.append(InitRecorder())
    if job.get("sigkill_at_step"):
        extra.append(SigKill(**job["sigkill_at_step"]))
    if job.get("rank_seed"):
        extra.append(RankSeed())
    ckpt_dir = job.get("ckpt_dir")
    listing_before = sorted(os.listdir(ckpt_dir)) if ckpt_dir and os.path.isdir(ckpt_dir) else []
    found = lightning_par.checkpoint.latest(ckpt_dir) if ckpt_dir else None
    resume = job.get("resume")
    if resume == "latest":
        resume = str(found) if found else None
    plugins = []
    precision = job.get("precision", "32-true")
    if job.get("lightning_fp16_reference"):
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        precision = None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=job.get("devices", world // job.get("num_nodes", 1)),
        num_nodes=job.get("num_nodes", 1),
        strategy=strategy,
        precision=precision,
        plugins=plugins or None,
        max_steps=job.get("max_steps", steps),
        max_epochs=job.get("max_epochs"),
        accumulate_grad_batches=accumulate,
        gradient_clip_val=job.get("clip"),
        logger=memory_logger if memory_logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=bool(job.get("ckpt_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([] if job.get("quiet") else [recorder]), *_checkpoint_callbacks(job), *extra],
        num_sanity_val_steps=job.get("num_sanity_val_steps", 0),
        limit_val_batches=job.get("limit_val_batches", 2),
        limit_test_batches=2,
    )
    if job.get("write_after_next_step"):  # which step each save was called at (`_patch_checkpoint_writes`)
        save = trainer.strategy.save_checkpoint

        def counted_save(*args: Any, **kwargs: Any) -> Any:
            with _STEP_ENDS:
                _STEPS["saves"].append(_STEPS["ended"])
                _STEP_ENDS.notify_all()
            return save(*args, **kwargs)

        trainer.strategy.save_checkpoint = counted_save  # type: ignore[method-assign]
    # empty_init: the model is built under trainer.init_module(empty_init=True), on the meta device.
    with trainer.init_module(empty_init=True) if job.get("empty_init") else contextlib.nullcontext():
        model = model_cls()
    # (no_routing: under a pipeline a rank routes only its stages' tokens, which this recorder cannot reassemble.)
    if isinstance(model, MoEGPT) and not job.get("no_routing"):  # known once built (the trainer exists first)
        trainer.callbacks.append(routing)
    if job.get("hf_from_pretrained"):  # the one-process reference of a pretrained start: transformers loads it
        if not hasattr(model, "model"):
            model.configure_model()  # a deferred model, built here (no strategy context: on the CPU)
        model.model = type(model.model).from_pretrained(job["hf_from_pretrained"], attn_implementation="eager")
    if job.get("expect_error"):
        try:
            with _patch_checkpoint_writes(job):
                trainer.fit(torch.compile(model) if job.get("torch_compile") else model, datamodule=data,
                            ckpt_path=resume)  # fmt: skip
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}", "losses": recorder.losses}
        return {"error": None, "losses": recorder.losses}
    caught: list[Any] = []
    # record_warnings: what the strategy warned about during fit (tensor-parallel fallbacks).
    scatters: list[int] = []  # count_reduce_scatter: how often FSDP2 reduced gradients during fit, on each rank
    with _patch_checkpoint_writes(job), _recorded_warnings(caught, bool(job.get("record_warnings"))), \
            _counted_reduce_scatters(scatters, bool(job.get("count_reduce_scatter"))):  # fmt: skip
        # torch_compile: fit what torch.compile returns (an OptimizedModule; our strategies compile per block).
        trainer.fit(torch.compile(model) if job.get("torch_compile") else model, datamodule=data, ckpt_path=resume)
    if job.get("count_reduce_scatter"):
        recorder.mem["reduce_scatters"] = len(scatters)
        recorder.mem["fsdp_groups"] = _fsdp_groups(trainer.strategy)
    if job.get("save"):
        trainer.save_checkpoint(job["save"])
    recorder.mem["expert_param_bytes"] = _local_bytes(p for n, p in model.named_parameters() if ".experts." in n)
    recorder.mem["expert_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}
    recorder.mem["expert_rows"] = routing.rows[0]
    mem_all: list[Any] = [recorder.mem]
    if dist.is_initialized():
        mem_all = [None] * dist.get_world_size()
        dist.all_gather_object(mem_all, recorder.mem)
    params = _full_params(model)
    _gather_experts(trainer, model, params)
    result: dict[str, Any] = {
        "mem_all": mem_all,
        "total_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "param_shapes": {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()},
        "losses": recorder.losses or [m["train_loss"] for m in (memory_logger.metrics if memory_logger else [])
                                      if "train_loss" in m],
        "ema": ema.avg if ema is not None else None,
        "probe": {"early": model.early, "after_step": model.after_step} if isinstance(model, ProbeGPT) else None,
        "prefetch": _prefetch_stats(trainer.strategy),
        "compiled_blocks": sum(bool(getattr(m, "_lp_compiled", False)) for m in model.modules()),
        "batch_heads": recorder.batch_heads,
        "local_losses": recorder.local_losses,
        "grad_norms": recorder.grad_norms,
        "mem": recorder.mem,
        "params": params,
        "routing": routing.global_order() if routing in trainer.callbacks else None,
        "init_state": next((c.state for c in extra if isinstance(c, InitRecorder)), None),
        # DeepSpeed backend, meta-built model: what materialising it cost each rank (parallel/deepspeed/meta_init.py).
        "meta_init_all": _gathered_objects(_asdict(getattr(trainer.strategy, "meta_init", None))),
        "layout": getattr(trainer.strategy, "parallel_layout", None),
        # auto_parallel: the layout the planner chose and its printed top three.
        "auto": _auto_choice(trainer.strategy),
        "per_rank_batch": data.batch_size,
        "ds_batch": _ds_batch(trainer.strategy),
        "optim_at_start": optim_recorder.state,
        "start_step": ckpt_recorder.start_step,
        "step_params": ckpt_recorder.step_params,
        "steps_while_writing": ckpt_recorder.steps_while_writing,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "ckpt_listing_before": listing_before,
        "latest_before": found.name if found else None,
        "ckpt_listing_after": sorted(os.listdir(ckpt_dir)) if ckpt_dir and os.path.isdir(ckpt_dir) else [],
        "resumed_from": Path(trainer.ckpt_path).name if trainer.ckpt_path else None,
        "draws": getattr(model, "draws", None),
        "warnings": [str(w.message) for w in caught] if job.get("record_warnings") else None,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "expert_load": monitor.expert_load if monitor is not None else None,
        "flops_per_token": monitor.flops_per_token if monitor is not None else None,
        "pictures": {k: tuple(v.shape) for k, v in monitor.last_pictures.items()} if monitor is not None else None,
        "timeline": monitor.last_pictures.get("pictures/pipeline_timeline") if monitor is not None else None,
        "monitor_metrics": monitor.last_metrics if monitor is not None else None,
        "logged": memory_logger.metrics if memory_logger is not None else None,
        "files_in_list_dir": sorted(str(p) for p in Path(job["list_dir"]).rglob("*") if p.is_file())
        if job.get("list_dir")
        else None,
    }
    if isinstance(trainer.strategy, lightning_par.ParallelStrategy):
        from torchmetrics import Metric

        dp_group = trainer.strategy.meshes.dp.get_group()
        metrics = [m for m in model.modules() if isinstance(m, Metric)]
        result["metric_groups_dp"] = bool(metrics) and all(m.process_group is dp_group for m in metrics)
        # Which FSDP2 offload policy each sharded unit got (a private attribute, read only by this test).
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in trainer.strategy.model.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in units]  # type: ignore[operator]
        result["fsdp_units"] = len(units)
        zero = getattr(trainer.strategy.parallel_run, "zero", None)
        outer = getattr(zero, "outer", None)
        result["outer_syncs"] = outer.syncs if outer is not None else None  # local SGD's synchronisations
        # Which param groups step with torch's multi-tensor kernels (ZeRO-3 and tp switch DTensor-only groups).
        result["optimizer_foreach"] = [g.get("foreach") for g in trainer.optimizers[0].param_groups]
        # How many DTensors the optimizer steps (tp at ZeRO-0 steps plain views of the shards: none).
        result["optimizer_dtensors"] = sum(
            isinstance(p, DTensor) for g in trainer.optimizers[0].param_groups for p in g["params"]
        )
        result["offload_policies"] = sorted({type(g.offload_policy).__name__ for g in groups if g is not None})
    if getattr(getattr(trainer.strategy, "config", None), "pp", 1) > 1:
        # Each rank holds its stages' parameters only: merge every rank's (data-parallel replicas agree).
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, result["params"])
        result["params"] = {k: v for d in every for k, v in d.items()}
        result["param_counts_all"] = [len(d) for d in every]
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, result["optim_at_start"])
        result["optim_at_start"] = {k: v for d in states for k, v in d.items()}
        local: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(local, recorder.local_losses)
        result["local_losses_all"] = local
        # Tied weights have a copy on each end stage, each under its rank's name for it (tests/test_pipeline_tied.py).
        pipeline = trainer.strategy.parallel_run.pipeline
        result["tied"] = pipeline.model.ownership.tied if pipeline is not None else []
    if job.get("validate"):
        result["val"] = {k: float(v) for k, v in trainer.validate(model, datamodule=data, verbose=False)[0].items()}
    if job.get("test"):
        result["test"] = {k: float(v) for k, v in trainer.test(model, datamodule=data, verbose=False)[0].items()}
    if job.get("predict"):
        preds = trainer.predict(model, datamodule=data)
        result["predict"] = [p.cpu() for p in preds] if preds is not None else None
    return result


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    results = [run_job(job) for job in spec["jobs"]]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        torch.save(results, spec["out"])
    clean_exit()


if __name__ == "__main__":
    main()
