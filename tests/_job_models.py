"""The models `tests/_worker.py` jobs train, by the name a job gives (`MODELS`): the library's GPT, Llama and MoE-GPT
at test sizes, variants of them (other optimizers, dropout, an injected failure, weights read where ZeRO's deferred
all-gather may still run), tiny user models of other shapes, and the families of tests/_families*.py."""

from __future__ import annotations

import functools
import importlib
import random
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_par.models import GPT, Llama, MoEGPT


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


class _MixBlock(torch.nn.Module):
    """A block that mixes the hidden state with the embedding's output by two weights it is handed."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor, x0: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        h = lam[0] * h + lam[1] * x0
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class ScalarsLM(_TinyLM):
    """modded-nanoGPT's pattern: learned scalars directly on the model that holds the blocks (a scale on the
    embedding, a pair of mixing weights per block handed to it with the embedding's output, a scale on the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList(_MixBlock() for _ in range(4))
        self.norm, self.head = torch.nn.LayerNorm(32), torch.nn.Linear(32, 256)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.lambdas = torch.nn.Parameter(torch.tensor([[1.0, 0.5]] * 4))
        self.out_scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x0 = self.emb(x) * self.scale
        for i, block in enumerate(self.blocks):
            h = block(h, x0, self.lambdas[i])
        return self.head(self.norm(h)) * self.out_scale

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoStacksLM(_TinyLM):
    """Two stacks of blocks run one after the other: ``front`` (3 blocks, the larger: what `find_trunk` picks) and
    ``blocks`` (2): a model whose trunk the user names (``ParallelStrategy(trunk="blocks")``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.front = torch.nn.ModuleList(_Residual(32) for _ in range(3))
        self.blocks = torch.nn.ModuleList(_Residual(32) for _ in range(2))
        self.norm, self.head = torch.nn.LayerNorm(32), torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in (*self.front, *self.blocks):
            h = block(h)
        return self.head(self.norm(h))


class _GateBlock(_MixBlock):
    """`_MixBlock` whose MLP output is scaled by a 0-dim gate of its own (ReZero's ``alpha``, here starting at 1)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__(d)
        self.gate = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, h: torch.Tensor, x0: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        h = lam[0] * h + lam[1] * x0
        return h + self.gate * self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Scalars0LM(ScalarsLM):
    """`ScalarsLM` with 0-dim parameters, as users write them: the scales on the model, a gate in every block, and a
    temperature the forward never uses (no gradient: one process leaves it untouched)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_GateBlock() for _ in range(4))
        self.scale = torch.nn.Parameter(torch.tensor(1.0))
        self.out_scale = torch.nn.Parameter(torch.tensor(1.0))
        self.unused = torch.nn.Parameter(torch.tensor(0.5))

    def configure_optimizers(self) -> Any:
        # Weight decay would move the unused parameter if it got a (zero) gradient.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


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


class _Permuted(_Residual):
    """A residual block that returns its output as a permuted view, as channels-last code does (ConvNeXt's blocks
    compute in (B, T, C) and permute back): the same values, not contiguous."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, scale).transpose(1, 2).contiguous().transpose(1, 2)


class PermutedLM(_TinyLM):
    """Four `_Permuted` blocks: the activation a pipeline stage hands on is a non-contiguous view."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.blocks = torch.nn.ModuleList([_Permuted(32) for _ in range(4)])
        self.head = torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        assert not h.is_contiguous()
        return self.head(h)


class TorchEncoderLM(_TinyLM):
    """torch's own ``nn.TransformerEncoder`` as users write it: its forward reads ``self.layers[0].self_attn`` (the
    fast-path check) whichever stage runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x)))


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


_PROBE = {"vocab_size": 258, "block_size": 34, "n_layer": 3, "n_head": 4, "n_embd": 36, "lr": 3e-3}


class _Models(dict):
    """The registry, and ``zoo:<model_type>``: any causal LM of the installed transformers, shrunk (tests/_zoo.py;
    ``zoo:<model_type>:sdpa`` with SDPA attention)."""

    def __missing__(self, key: str) -> Any:
        if not key.startswith("zoo:"):
            raise KeyError(key)
        _, model_type, *attn = key.split(":")
        return lambda: importlib.import_module("_zoo").ZooLM(model_type, *attn)


MODELS: dict[str, Any] = _Models({
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
    "hf_llama4": lambda: _families_moe().HFLlama4(),  # experts called on a dense [E*T, d] routed input
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
    "hf_dbrx": lambda: _families_moe().HFDbrx(),  # experts stored flat, [E * f, d]
    "hf_dbrx_aux": lambda: _families_moe().HFDbrx(aux=True),  # its load-balancing loss in the loss
    # Blocks of two structures (attention, feed-forward, ...), as x-transformers lays out its layers.
    "user_alternating": lambda: _tp_mixed_models().AlternatingLM(),
    "user_inner_norm": lambda: _tp_mixed_models().AlternatingLM(inner=True),  # norms inside the regions
    "user_rel_bias": lambda: _rel_bias_models().RelBiasLM(),  # a per-head bias table, its bias passed on
    "looped_lm": lambda: _looped_models().LoopedLM(),  # a core block run three times: the calls [0, 1, 1, 1, 2]
    "user_post_norm": lambda: _tp_mixed_models().PostNormLM(),  # residual + norm inside the attention module
    "user_lora": lambda: _lora_models().UserLoRALM(),  # a user's LoRA wrappers on every projection
    "peft_llama": lambda: _lora_models().PeftLlama(),  # peft.get_peft_model(LoRA) on Hugging Face Llama
    # peft's default targets for Llama: q and v alone (k and o, gate, up, down plain beside them)
    "peft_llama_qv": lambda: _lora_models().PeftLlama(targets=("q_proj", "v_proj")),
    "peft_llama_dora": lambda: _lora_models().PeftLlama(dora=True),  # DoRA: a magnitude vector per projection
    "peft_llama_dora_drop": lambda: _lora_models().PeftLlama(dora=True, drop=True),  # DoRA recomputes the base
    "peft_llama_dora_sdpa": lambda: _lora_models().PeftLlama(dora=True, attn="sdpa"),  # for cp
    "peft_phi3": lambda: _lora_models().peft_phi3(),  # LoRA on fused projections
    "peft_phi3_dora": lambda: _lora_models().peft_phi3(dora=True),  # DoRA on fused projections: refused under tp
    "peft_llama_sdpa": lambda: _lora_models().PeftLlama(attn="sdpa"),  # for cp
    "peft_mixtral": lambda: _lora_models().PeftMixtral(),  # LoRA on the attention of an MoE model
    "peft_mixtral_experts": lambda: _lora_models().PeftMixtralExperts(),  # LoRA on the stacked experts too
    "qlora_llama": lambda: _lora_models().QLoRALlama(),  # peft LoRA over NF4 base weights (torchao)
    "peft_llama_meta": lambda: _lora_models().PeftLlamaMeta(),  # built in configure_model (meta), B zero
    "hf_llama_sgd": lambda: _lora_models().HFLlamaSGD(),  # the base alone, SGD as the adapted models
    # Four blocks: room for 2 stages x 2 virtual stages per rank (interleaved and V schedules).
    "gpt4": lambda: GPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32, lr=3e-3),
    "llama4": lambda: Llama(vocab_size=256, max_seq_len=32, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                            ffn_hidden=64, lr=3e-3),
    "gpt4_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32),
    "gpt8_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=32),  # vpp up to 4 at pp 2
    "gpt_adafactor": lambda: AdafactorGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "muon_lm": MuonLM,
    "seq_trunk": lambda: SeqTrunkLM(),
    "skip_groups": lambda: SkipLM("groups"),  # skip connections inside groups of blocks: one cut keeps the values
    "skip_unet": lambda: SkipLM("unet"),  # skip connections across every cut: pipelines refuse it
    "scalars_lm": ScalarsLM,  # learned scalars on the model that holds the blocks (modded-nanoGPT)
    "two_stacks_lm": TwoStacksLM,  # two stacks of blocks: the trunk named by the user
    "scalars0_lm": Scalars0LM,  # 0-dim parameters: on the model, in every block, and one never used
    "torch_encoder": TorchEncoderLM,  # nn.TransformerEncoder: its forward reads the first layer's attributes
    "torch_causal_encoder": lambda: _mha_models().CausalEncoderLM(),  # sequence-first, float mask, is_causal
    "user_mha": lambda: _mha_models().UserMHALM(),  # nn.MultiheadAttention called by the user's blocks
    "user_mha_block_mask": lambda: _mha_models().UserMHALM(mask_in_block=True),  # mask sized from the block input
    "torch_decoder": lambda: _mha_models().CrossDecoderLM(),  # cross-attention to a memory every block reads
    "permuted_views": PermutedLM,  # blocks return non-contiguous views: a pipeline's wire must be dense
    "dict_trunk": lambda: DictTrunkLM(),
    "gpt4_tied_sgd": lambda: SGDGPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32, tie_weights=True),
    # Families we did not write (tests/_families.py), each a plain user LightningModule with SGD + momentum.
    "litgpt_pythia": lambda: _families().LitGPTPythia(),
    "litgpt_llama": lambda: _families().LitGPTLlama(),
    "xt_decoder": lambda: _families().XTransformersDecoder(),  # None entries in its ModuleLists
    "hf_gpt2": lambda: _families().HFGPT2(),
    "hf_qwen2_tied": lambda: _families().HFQwen2Tied(),
    "hf_vit": lambda: _families().HFViT(),
    "hf_convnext": lambda: _families().HFConvNext(),
    "hf_bert": lambda: _families().HFBert(),
    "hf_albert": lambda: _families().HFAlbert(),  # one layer's weights at every depth
    "grouped_lm": lambda: _families().GroupedLM(),  # fused qkv interleaved per k/v group
    "hf_phi3": lambda: _families().HFPhi3(),  # fused qkv_proj and gate_up_proj
    "hf_falcon_mqa": lambda: _families().HFFalconMQA(),  # one k/v head in a fused qkv: replicated under tp
    "hf_llama_mqa": lambda: _families().HFLlamaMQA(),  # one k/v head in separate projections
    "mqa_lm": lambda: _families().MQALM(),  # a user's multi-query attention
    "glu_lm": lambda: _families().GluLM(),  # a user's fused [gate | up] MLP
    "hf_swin": lambda: _families().HFSwin(),  # hierarchical: length and width change between stages
    "pyramid_lm": lambda: _families().PyramidLM(),  # a user's hierarchical model: blocks return (hidden, length)
    "pyramid_unprobed": lambda: _families().PyramidLM(example=False),  # no example_input_array: the probe fails
    "hf_t5": lambda: _families().HFT5(),  # encoder-decoder: the decoder reads the encoder's output
    "hf_t5_4": lambda: _families().HFT5(layers=4),  # 4 decoder blocks
    "hf_bart": lambda: _families().HFBart(),  # encoder-decoder, post-norm, learned positions
    "nano_lm": lambda: _families().NanoLM(),  # sizes its split by x.size(-1): run on gathered outputs under tp
    # nanoGPT itself (its SDPA path; its manual attention with the causal-mask buffer), and with per-head q/k norms
    # (refused under tp: the norms would need the heads split).
    "nano_gpt": lambda: _nano_models().NanoGPT(),
    "nano_gpt_manual": lambda: _nano_models().NanoGPT(flash=False),
    "nano_gpt_qk_norm": lambda: _nano_models().NanoGPT(qk_norm=True),
})  # fmt: skip


# Test-only model modules, imported when a job first builds one of their models (_families needs litgpt and
# transformers, _families_moe and _hf_models transformers).
_families_moe = functools.partial(importlib.import_module, "_families_moe")
_tp_mixed_models = functools.partial(importlib.import_module, "_tp_mixed_models")
_rel_bias_models = functools.partial(importlib.import_module, "_rel_bias_models")
_looped_models = functools.partial(importlib.import_module, "_looped_models")
_mha_models = functools.partial(importlib.import_module, "_mha_models")
_families = functools.partial(importlib.import_module, "_families")
_nano_models = functools.partial(importlib.import_module, "_nano_models")
_lora_models = functools.partial(importlib.import_module, "_lora_models")
_hf_models = functools.partial(importlib.import_module, "_hf_models")
