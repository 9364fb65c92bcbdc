"""Expert parallelism (GShard, Lepikhin et al. 2020, arXiv 2006.16668): each rank of an ``ep`` group holds
``E/ep`` experts, and tokens travel to their experts and back with all-to-all.

Layout. ``ep`` is carved out of the data-parallel ranks: the ``dp`` ranks are viewed as ``(dp/ep) x ep``
(`lightning_par.mesh.ExpertMesh`); the ``ep`` ranks of a row hold different experts and exchange tokens, and the
``edp = dp/ep`` ranks of a column hold the same experts (expert data parallelism).

Tokens travel with `experts.dispatch.ExpertDispatch` (four all-to-alls per MoE layer and step); MoE layers we did
not write get an adapter around the same exchange: `experts.stacked` (stacked expert weights, the Hugging Face
families) and `experts.module_list` (an ``nn.ModuleList`` of MLPs). Their own routers and losses are kept;
`experts.router_stats` makes a Hugging Face router's recorded logits span the data-parallel batch.

Gradients. Each rank's loss is the mean over its own batch, and the strategy averages dense gradients over the
``dp`` ranks. An expert's gradient on a rank already sums the contributions of the tokens of every rank of its
``ep`` group (the backward all-to-all brought them); summing over the ``edp`` ranks that hold the same expert adds
the rest of the ``dp`` ranks, so the average is that sum divided by ``dp`` (not by ``edp``): exactly the
gradient of the mean loss over the global batch, as one process computes it.

Under context parallelism (cp x ep): the ep group is the data-parallel ranks with this rank's cp index, and
``edp`` spans cp too (`lightning_par.mesh.ExpertMesh`). Rank r's expert gradient is then ``cp x`` the part of its
own chunk (cp's trunk-exit backward), so the same sum over ``edp``, divided by ``dp x cp``, is exact.

Under tensor parallelism (tp x ep, `experts.with_tp`): the ep group is the data-parallel ranks with this rank's tp
index.
With ``etp = 1`` each tp rank computes its share of the tokens, so expert gradients are summed over tp as well;
with ``etp = tp`` each tp rank holds a slice of every local expert's hidden width (a shard over ep and tp) and
computes every token on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_par.axes import does_not_divide
from lightning_par.mesh import ExpertMesh
from lightning_par.parallel.experts.dispatch import ExpertDispatch
from lightning_par.parallel.experts.finder import MoELayer, find_moe_layers, unrecognised_experts
from lightning_par.parallel.experts.module_list import shard_module_list_experts
from lightning_par.parallel.experts.router_stats import gather_router_logits, lone_logits_error, records_lone_logits
from lightning_par.parallel.experts.stacked import local_expert_adapters, shard_stacked_experts
from lightning_par.parallel.experts.with_tp import ExpertShard, TokenSplit
from lightning_par.parallel.grad_norm import mark_sharded


class ExpertParallel:
    """The applied expert parallelism: which parameters are expert shards, and their gradient reduction.

    Args:
        layers: the MoE layers found in the model.
        params: the expert-shard parameters by qualified name (excluded from the data-parallel / ZeRO engine).
        full_shapes: the shape before sharding (all ``E`` experts) of each stacked expert weight; the parameters of
            ``nn.ModuleList`` experts, whole on their rank, have none.
        mesh: the expert mesh; ``None`` when ``ep == 1``.
        tp_group: the tensor-parallel group when the experts run inside one (tp x ep), else ``None``.
        tp_dims: under ``etp = tp``, the dimension of each expert weight split over tp; empty otherwise (each tp
            rank then computes a share of the tokens, and the gradients are summed over tp).
    """

    def __init__(
        self,
        layers: list[MoELayer],
        params: dict[str, nn.Parameter],
        full_shapes: dict[str, torch.Size],
        mesh: Optional[ExpertMesh],
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_dims: Optional[dict[str, int]] = None,
    ) -> None:
        self.layers, self.mesh, self.tp_group = layers, mesh, tp_group
        self.tp_dims = tp_dims or {}
        self.names = params  # qualified name -> this rank's shard
        self.params = list(params.values())
        self._full_shapes = full_shapes
        # Checkpoint keys of the nn.ModuleList experts other ep ranks hold: expected in a checkpoint, not loaded here.
        self.remote_keys: frozenset[str] = frozenset()

    def distribute(self, name: str, value: Any) -> Any:
        """Wrap a tensor shaped like the named expert shard (the weight, or its optimizer state) as the ``Shard(0)``
        DTensor over ``ep`` of the full stacked weight, for sharded checkpoints; anything else is returned as is.

        Ranks of different ``edp`` rows write the same chunks; DCP keeps one copy of each.
        """
        shard = self.names.get(name)
        if shard is None or name not in self._full_shapes or self.mesh is None:
            return value  # a ModuleList expert is whole on its rank: saved under its own name as is
        if not isinstance(value, Tensor) or value.shape != shard.shape:
            return value
        full = self._full_shapes[name]
        stride = torch.empty(full, device="meta").stride()
        if name in self.tp_dims and self.mesh.tp_ep is not None:  # etp = tp: sliced over tp, then over ep
            placements = (Shard(self.tp_dims[name]), Shard(0))
            return DTensor.from_local(value, self.mesh.tp_ep, placements, shape=full, stride=stride, run_check=False)
        return DTensor.from_local(value, self.mesh.ep, (Shard(0),), shape=full, stride=stride, run_check=False)

    def distribute_then(self, other: Optional[Callable[[str, Any], Any]]) -> Callable[[str, Any], Any]:
        """`distribute` for expert names, ``other`` (e.g. ZeRO's optimizer-state wrapper) for the rest."""

        def both(name: str, value: Any) -> Any:
            if name in self.names or other is None:
                return self.distribute(name, value)
            return other(name, value)

        return both

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average expert gradients over the data-parallel ranks: sum over ``edp`` (and over tp when each tp rank
        computed a share of the tokens), divide by ``dp`` (times ``cp``, which ``edp`` then spans)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or self.mesh is None:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.mesh.edp.size() > 1:
            dist.all_reduce(flat, group=self.mesh.edp.get_group())
        if self.tp_group is not None and not self.tp_dims:
            dist.all_reduce(flat, group=self.tp_group)
        flat.div_(self.mesh.dp_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def apply_expert_parallel(
    model: nn.Module,
    mesh: Optional[ExpertMesh],
    token_group: Optional[dist.ProcessGroup],
    tp_group: Optional[dist.ProcessGroup] = None,
    etp: int = 1,
    cp_group: Optional[dist.ProcessGroup] = None,
    *,
    require_layers: bool = True,
) -> ExpertParallel:
    """Shard the experts of every recognised MoE layer of ``model`` over ``mesh.ep``, in place.

    Each rank keeps rows ``[r*E/ep, (r+1)*E/ep)`` of the stacked expert weights (the rest is freed), under the
    original parameter names. Call after the data-parallel replicas were made equal and before the optimizer is
    built. With ``ep == 1`` only the token group is set (capacity and balancing statistics over the global batch).

    Args:
        model: the module to change.
        mesh: the expert mesh (``ep`` and ``edp`` axes); ``None`` for ``ep == 1``.
        token_group: the ranks whose tokens form one batch for capacity and load-balancing statistics (the
            data-parallel ranks, and the cp ranks under context parallelism), or ``None`` for one process.
        tp_group: the tensor-parallel group, when the MoE layers sit in a tp group that holds the same tokens on
            every rank (``ep > 1`` only; at ``ep == 1`` the layers run whole on every tp rank).
        etp: ``1``: each tp rank computes ``1/tp`` of the tokens; the tp size: each expert's hidden width is split
            over tp (`lightning_par.nn.MoE` layers only).
        cp_group: the context-parallel group under ``cp > 1`` (``token_group`` then spans dp x cp): our layers'
            per-sample means (the auxiliary losses' ``P_e``, the z-loss) span the chunks of one sample.
        require_layers: refuse ``ep > 1`` without a recognised MoE layer; ``False`` for a pipeline stage of a model
            whose MoE layers all sit on other stages (a dense first block).

    Raises:
        ValueError: ``ep`` does not divide a layer's number of experts (the message lists valid choices), ``ep > 1``
            and the model has no recognised MoE layer, or ``etp`` cannot split a layer's experts.
    """
    ep = mesh.ep.size() if mesh is not None else 1
    layers = find_moe_layers(model)
    unknown = unrecognised_experts(model, layers) if ep > 1 else []
    if unknown:
        raise ValueError(
            f"ep={ep}: {type(model).__name__} has experts that expert parallelism does not recognise, in "
            + "; and in ".join(unknown)
            + ". Train it with a data-parallel strategy (e.g. 'zero3', which shards every parameter whatever the "
            "model's structure) or ep=1"
        )
    if ep > 1 and not layers and require_layers:
        raise ValueError(
            f"ep={ep} but {type(model).__name__} has no MoE layer of a recognised kind (lightning_par.nn.MoE, or a "
            "block with a router [E, d] and E experts, stacked or in an nn.ModuleList); use a data-parallel strategy "
            "(e.g. 'zero2') or ep=1"
        )
    params: dict[str, nn.Parameter] = {}
    full_shapes: dict[str, torch.Size] = {}
    tp_dims: dict[str, int] = {}
    remote: set[str] = set()
    tp_group = tp_group if ep > 1 and tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    if etp > 1:
        _check_etp(layers, etp, dist.get_world_size(tp_group) if tp_group is not None else 1)
    for layer in layers:
        if layer.n_experts % ep:
            raise ValueError(
                does_not_divide("ep", ep, "n_experts", layer.n_experts, layer.name)
                + " (and dividing the data-parallel size)"
            )
        layer.set_token_group(token_group, cp_group)
        if layer.kind == "stacked" and layer.router is not None and token_group is not None:
            if dist.get_world_size(token_group) > 1:
                if records_lone_logits(model, layer.router):  # refused before training, not at the first forward
                    raise lone_logits_error(layer.router)
                gather_router_logits(layer.router, token_group, cp_group)
        if mesh is None or ep == 1:
            continue
        rank = mesh.ep.get_local_rank()
        n_local = layer.n_experts // ep
        experts = layer.experts
        prefix = _qualified_name(model, experts)
        tp_mode = (ExpertShard(tp_group) if etp > 1 else TokenSplit(tp_group)) if tp_group is not None else None
        hooks = ExpertDispatch(mesh.ep.get_group(), ep, n_local, tp_mode)
        if layer.kind == "module_list":
            local = range(rank * n_local, (rank + 1) * n_local)
            entries = [n for n, _ in layer.experts[0].state_dict().items()]  # type: ignore[index]
            remote |= {f"state_dict.{prefix}{e}.{n}" for e in range(layer.n_experts) if e not in local for n in entries}
            kept = shard_module_list_experts(layer.module, experts, hooks, rank, n_local, prefix[:-1])  # type: ignore[arg-type]
            for i, module in enumerate(kept):
                for name, p in module.named_parameters():
                    mark_sharded(p, (mesh.ep.get_group(),))
                    params[f"{prefix}{rank * n_local + i}.{name}"] = p
            continue
        for name, p in list(experts.named_parameters()):
            per = p.shape[0] // layer.n_experts  # rows per expert: 1 stacked [E, ...], f flat [E * f, d] (DBRX)
            rows = p.detach()[rank * n_local * per : (rank + 1) * n_local * per]
            groups: tuple[dist.ProcessGroup, ...] = (mesh.ep.get_group(),)
            if etp > 1 and tp_group is not None:
                dim = _ETP_DIMS[name]  # w1, w3 [E, d, f]: columns of f; w2 [E, f, d]: rows of f
                width = rows.shape[dim] // etp
                rows = rows.narrow(dim, dist.get_rank(tp_group) * width, width)
                groups, tp_dims[prefix + name] = (*groups, tp_group), dim
            shard = nn.Parameter(rows.clone(), p.requires_grad)
            mark_sharded(shard, groups)  # the global gradient norm sums these over ep (and tp when split over it)
            owner, _, leaf = name.rpartition(".")
            setattr(experts.get_submodule(owner) if owner else experts, leaf, shard)
            params[prefix + name] = shard
            full_shapes[prefix + name] = p.shape
        if layer.kind == "stacked":
            shard_stacked_experts(experts, hooks, layer.n_experts, prefix[:-1])
            local_expert_adapters(layer.module, experts, rank * n_local, n_local)
        else:
            experts.register_forward_pre_hook(hooks.dispatch)
            experts.register_forward_hook(hooks.combine)
    applied = ExpertParallel(layers, params, full_shapes, mesh, tp_group, tp_dims)
    applied.remote_keys = frozenset(remote)
    return applied


# The dimension of each lightning_par.nn.Experts weight that holds the hidden width f.
_ETP_DIMS = {"w1": 2, "w3": 2, "w2": 1}


def _check_etp(layers: list[MoELayer], etp: int, tp_size: int) -> None:
    """Refuse an ``etp`` that cannot split these layers' experts, naming the fix (before training)."""
    if tp_size != etp:
        raise ValueError(
            f"etp={etp} splits each expert over the tensor-parallel group, but the experts run in a tp group of "
            f"{tp_size} with ep > 1 here; set etp=1 (each tp rank computes its share of the tokens) or etp=tp with "
            "tp > 1 and ep > 1"
        )
    for layer in layers:
        if layer.kind != "lightning_par":
            raise ValueError(
                f"etp={etp}: {layer.name} is a {layer.kind} MoE block; only lightning_par.nn.MoE experts (stacked "
                "w1/w2/w3) are split over tp here (other families keep their own expert math); set etp=1, which "
                "still splits the tokens over tp"
            )
        hidden = layer.experts.w1.shape[2]  # type: ignore[union-attr, index]
        if hidden % etp:
            choices = "{" + ", ".join(str(d) for d in range(1, hidden + 1) if hidden % d == 0) + "}"
            raise ValueError(
                f"etp={etp} does not divide the expert hidden size d_ff={hidden} in {layer.name}; choose etp=1 (the "
                f"tokens are split over tp instead), or tp = etp in {choices}"
            )


def _qualified_name(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}." if name else ""
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")
