"""Tokens per expert of every MoE layer, per optimizer step, over the global batch (for `ParallelismMonitor`).

What is counted is what each layer routes with, so the figures are the same on every layout of one model:

- `lightning_par.nn.MoE`: its ``stats`` after each forward (this rank's chosen experts and which assignments were
  within capacity);
- a recognised Hugging Face block whose router returns ``(logits, weights, index)`` (the layout of transformers'
  top-k routers): ``index``, the experts the block dispatches to; dropless, so nothing is dropped;
- a router returning only ``[N, E]`` logits: the top-k of those logits, which is the block's choice for softmax or
  sigmoid top-k routing; a block that adds a selection bias or routes by groups (DeepSeek-V3) chooses otherwise,
  and its counts are then approximate. Layers whose router is a bare parameter are not counted.

Forwards are summed over a step's microbatches (gradient accumulation, pipeline microbatches) and over the ranks
whose tokens differ (``group``); recomputation under activation checkpointing is not counted again
(`lightning_par.parallel.activation_checkpointing.recomputing`). Under pipeline parallelism each stage counts its
own layers, and `ExpertLoad.collect` merges every rank's layers by name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_par.nn import MoE
from lightning_par.parallel.activation_checkpointing import recomputing
from lightning_par.parallel.experts.finder import MoELayer, find_moe_layers
from lightning_par.parallel.experts.router_stats import is_top_k_output


class ExpertLoad:
    """Count the tokens each expert of ``module``'s MoE layers receives, until `collect`.

    Args:
        module: the model; its MoE layers are found by `lightning_par.parallel.experts.finder.find_moe_layers`.
        group: the ranks whose tokens differ (data parallel); ``None``: this process's tokens are the batch.
        layers: the layers to count (a strategy that sharded the experts found them before, with their global
            expert counts); ``None``: `find_moe_layers` on ``module``.
    """

    def __init__(
        self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, layers: Optional[list[MoELayer]] = None
    ) -> None:
        self.group = group
        found = layers if layers is not None else find_moe_layers(module)
        self.layers = [layer for layer in found if _countable(layer)]
        self._counts: dict[str, Tensor] = {}
        self._dropped: dict[str, float] = {}
        self._handles: list[RemovableHandle] = []
        for layer in self.layers:
            self._counts[layer.name] = torch.zeros(layer.n_experts, dtype=torch.float64)
            self._dropped[layer.name] = 0.0
            target = layer.module if isinstance(layer.module, MoE) else layer.router
            assert target is not None  # `_countable`
            # First, before hooks that change the output (experts.router_stats gathers the logits over the batch).
            self._handles.append(target.register_forward_hook(self._hook(layer), prepend=True))

    def _hook(self, layer: MoELayer) -> Any:
        def count(module: nn.Module, args: Any, out: Any) -> None:
            if not module.training or recomputing():
                return
            if isinstance(module, MoE):
                index, kept = module.stats["expert_index"], module.stats["kept"]
                index = index[kept]
                self._dropped[layer.name] += float((~kept).sum())
            elif is_top_k_output(out):
                index = out[2]
            elif isinstance(out, Tensor) and out.dim() >= 2 and out.shape[-1] == layer.n_experts and layer.top_k:
                index = out.detach().topk(layer.top_k, dim=-1).indices
            else:
                return
            counts = torch.bincount(index.reshape(-1).long().cpu(), minlength=layer.n_experts)
            self._counts[layer.name] += counts[: layer.n_experts].to(torch.float64)

        return count

    def collect(self, device: torch.device) -> dict[str, dict[str, Any]]:
        """Every layer's counts since the last call, summed over ``group`` and merged over all ranks; then reset.

        Every rank must call it at the same step (it runs collectives when a process group exists).

        Args:
            device: where the reduction runs (the strategy's root device: NCCL rejects CPU tensors).

        Returns:
            per layer name: ``tokens_per_expert`` (float64 ``[E]``) and ``dropped_fraction`` (of assignments).
        """
        names = [layer.name for layer in self.layers]
        rows = [torch.cat([self._counts[n], torch.tensor([self._dropped[n]], dtype=torch.float64)]) for n in names]
        local = torch.stack(rows) if rows else torch.zeros(0, 1, dtype=torch.float64)
        if self.group is not None and names and dist.get_world_size(self.group) > 1:
            # The ranks of one data-parallel group hold the same layers (same stage, same tp index), in one order.
            reduced = local.to(device)
            dist.all_reduce(reduced, group=self.group)
            local = reduced.cpu()
        mine = {n: row.tolist() for n, row in zip(names, local)}
        merged: dict[str, list[float]] = {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)  # other pipeline stages hold other layers
            for part in everyone:
                for name, row in part.items():
                    merged.setdefault(name, row)  # replicas (tp, and dp after the reduction) agree
        else:
            merged = mine
        self.reset()
        out = {}
        for name, row in merged.items():
            counts = torch.tensor(row[:-1], dtype=torch.float64)
            assignments = float(counts.sum()) + row[-1]
            out[name] = {"tokens_per_expert": counts, "dropped_fraction": row[-1] / assignments if assignments else 0.0}
        return out

    def reset(self) -> None:
        """Forget the counts since the last `collect` (a step that is not logged); no collective."""
        for n in self._counts:
            self._counts[n].zero_()
            self._dropped[n] = 0.0

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _countable(layer: MoELayer) -> bool:
    return isinstance(layer.module, MoE) or layer.router is not None


def load_metrics(load: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Scalars to log from `ExpertLoad.collect`: per layer the busiest expert's load over the mean (1 = balanced)
    and the dropped fraction, plus their worst / mean over layers (``experts/load_max_over_mean``,
    ``experts/dropped_fraction``)."""
    out: dict[str, float] = {}
    ratios, dropped = [], []
    for name, v in load.items():
        counts: Tensor = v["tokens_per_expert"]
        mean = float(counts.mean()) if counts.numel() else 0.0
        ratio = float(counts.max()) / mean if mean > 0 else 0.0
        out[f"experts/{name}/load_max_over_mean"] = ratio
        out[f"experts/{name}/dropped_fraction"] = float(v["dropped_fraction"])
        ratios.append(ratio)
        dropped.append(float(v["dropped_fraction"]))
    if ratios:
        out["experts/load_max_over_mean"] = max(ratios)
        out["experts/dropped_fraction"] = sum(dropped) / len(dropped)
    return out
