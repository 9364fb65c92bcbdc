"""The planner's list of parameters: each tensor's name, shape and what every parallel technique does to it, from a
`ModelDesc` (`specs_from_desc`: the tensors the Hugging Face class builds, by its names) or from the user's own
module (`specs_from_module`: the suite's introspection, so the planner prices what the strategies will do).

What the suite does, and so what a `ParamSpec` records:
- tensor parallelism splits the projections of the trunk's blocks (column-parallel q/k/v, gate/up on their output
  dim, row-parallel o/down on their input dim; a ``Conv1D``'s ``[in, out]`` weight the other way round) and keeps
  the token embedding, the head, the final norm and any mixture-of-experts layer replicated
  (`lightning_par.parallel.tensor.apply`: a vocabulary-parallel head would need a vocabulary-parallel loss in
  the user's ``training_step``);
- expert parallelism splits stacked expert weights along their expert axis (dim 0), or keeps whole experts of an
  ``nn.ModuleList`` on the rank that owns them (`lightning_par.parallel.experts.apply`);
- a pipeline gives each stage its blocks, the first stage what runs before the trunk and the last what runs after
  it; a weight used on both sides (a tied embedding and head) lives on both (`lightning_par.parallel.pipeline.stages`).

Pure shapes: no process group, and the module may sit on the meta device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from torch import nn

from lightning_par.planner.model import ModelDesc

ENDS = ("first", "last", "both", "every")
# "norm": a norm on a block's residual stream (replicated under tp; sequence parallelism sums its gradient over tp);
# "head_norm": a per-head q/k norm (replicated; its gradient is always summed over tp when the heads are split);
# "router": the router of a stacked-experts layer (the suite gathers its logits over the token group).
ROLES = ("", "norm", "head_norm", "router", "adapter_a", "adapter_b")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as the planner sees it.

    Args:
        name: its qualified name (the first one ``named_parameters`` gives a tied tensor).
        shape: its full shape, before any parallelism.
        dtype_bytes: bytes per element when fixed by the model; ``None``: the precision decides (4, or 2 under
            ``bf16-true``).
        tp_dim: the dim tensor parallelism splits over tp, ``None`` when replicated on every tp rank.
        tp_row: the weight of a row-parallel projection: the output of a split region (attention's output
            projection, the MLP's down projection), whose matmul result is reduced over tp.
        expert_axis: the dim expert parallelism splits over ep (stacked expert weights: 0), ``None`` otherwise.
        expert: ``(index, n_experts)`` of a whole expert of an ``nn.ModuleList``, held by the ep rank owning it.
        block: index of the trunk block holding it; ``None`` for what runs outside the trunk. In a trunk whose blocks
            run more than once (ALBERT) the index of its block's first call.
        end: outside the trunk: the pipeline end stage holding it (``"first"``, ``"last"`` or ``"both"``), or
            ``"every"`` stage (a parameter directly on the module that holds the trunk).
        tied_with: the other names of the same tensor.
        lookup: it is an embedding table (on the first stage: a lookup, no FLOPs, so the pipeline split does not
            charge it; a tied table is charged to the last stage, where it is the head's matmul).
        role: one of `ROLES` (``adapter_a`` / ``adapter_b``: the two projections of a low-rank adapter whose base
            tensor parallelism splits).
        trainable: ``requires_grad`` (frozen parameters hold no gradient and no optimizer state).
        calls: where its block runs more than once in one forward, the trunk calls it runs at: every pipeline stage
            holds it, and each call costs a stage its compute.
        quantised: a weight stored in a quantised format (QLoRA's NF4): ``(its bytes, the bytes every ZeRO-3 shard
            carries whole)``; `quantised_bytes`.
        region: the attention or MLP module holding it that tensor parallelism splits (its qualified name), or
            ``""``: where its gradient starts to flow backward decides which of a region's collectives run
            (`lightning_par.planner.comm`).
        fp8: the weight of a layer fp8 training converts (`lightning_par.planner.fp8.mark_fp8`).
    """

    name: str
    shape: tuple[int, ...]
    dtype_bytes: Optional[int] = None
    tp_dim: Optional[int] = None
    tp_row: bool = False
    expert_axis: Optional[int] = None
    expert: Optional[tuple[int, int]] = None
    block: Optional[int] = None
    end: Optional[str] = None
    tied_with: tuple[str, ...] = ()
    lookup: bool = False
    role: str = ""
    trainable: bool = True
    calls: tuple[int, ...] = ()
    quantised: Optional[tuple[int, int]] = None
    region: str = ""
    fp8: bool = False

    def __post_init__(self) -> None:
        for dim, what in ((self.tp_dim, "tp_dim"), (self.expert_axis, "expert_axis")):
            if dim is not None and not 0 <= dim < len(self.shape):
                raise ValueError(f"{self.name}: {what}={dim} is not a dim of shape {self.shape}")
        if (self.block is None) == (self.end is None):
            raise ValueError(
                f"{self.name}: give exactly one of block= (inside the trunk) and end= (outside it, one of {ENDS})"
            )
        if self.end is not None and self.end not in ENDS:
            raise ValueError(f"{self.name}: end={self.end!r} must be one of {ENDS}")
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role={self.role!r} must be one of {ROLES}")

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)


# ---- from a ModelDesc: the tensors the Hugging Face classes build --------------------------------------------------
def specs_from_desc(desc: ModelDesc) -> list[ParamSpec]:
    """The parameters of the Hugging Face model ``desc`` describes, under its names and shapes.

    GPT-2 naming (``transformer.h.{i}``, ``Conv1D`` weights stored ``[in, out]``) for a LayerNorm model without a
    gated MLP, Llama / Mixtral naming (``model.layers.{i}``, Linear weights ``[out, in]``, stacked experts
    ``gate_up_proj [E, 2f, h]`` and ``down_proj [E, h, f]``) otherwise. Tensor-parallel dims are those the suite
    infers for these classes. Their element count equals ``desc.total_params``.

    Args:
        desc: the model's shapes (`lightning_par.planner.from_hf_config`).
    """
    specs = _gpt2_specs(desc) if desc.layernorm and not desc.gated_mlp and not desc.experts else _llama_specs(desc)
    return [dataclasses.replace(s, region=_desc_region(s.name, desc)) for s in specs]


def _desc_region(name: str, desc: ModelDesc) -> str:
    # The split attention and MLP modules of these namings (an MoE layer is kept whole under tp: no region).
    parts = name.split(".")
    for token in ("self_attn", "attn", "mlp"):
        if token in parts and not (token == "mlp" and desc.experts):
            return ".".join(parts[: parts.index(token) + 1])
    return ""


def _norm(prefix: str, desc: ModelDesc, **kw: object) -> list[ParamSpec]:
    names = ("weight", "bias") if desc.layernorm else ("weight",)
    return [ParamSpec(f"{prefix}.{n}", (desc.hidden,), **kw) for n in names]  # type: ignore[arg-type]


def _linear(prefix: str, n_in: int, n_out: int, desc: ModelDesc, style: str, block: int) -> list[ParamSpec]:
    """An ``nn.Linear`` ``[out, in]``: column-parallel splits dim 0 and the bias, row-parallel dim 1 only."""
    col = style == "colwise"
    specs = [ParamSpec(f"{prefix}.weight", (n_out, n_in), tp_dim=0 if col else 1, tp_row=not col, block=block)]
    if desc.bias:
        specs.append(ParamSpec(f"{prefix}.bias", (n_out,), tp_dim=0 if col else None, block=block))
    return specs


def _llama_specs(desc: ModelDesc) -> list[ParamSpec]:
    h, q, kv, f, e = desc.hidden, desc.heads * desc.head_dim, desc.kv_heads * desc.head_dim, desc.ffn, desc.experts
    tied = ("lm_head.weight",) if desc.tied_embeddings else ()
    specs = [ParamSpec("model.embed_tokens.weight", (desc.vocab, h), end="both" if tied else "first",
                       tied_with=tied, lookup=True)]  # fmt: skip
    if desc.learned_positions:
        specs.append(ParamSpec("model.embed_positions.weight", (desc.learned_positions, h), end="first", lookup=True))
    for i in range(desc.layers):
        p = f"model.layers.{i}"
        for name, n_in, n_out, style in (("q_proj", h, q, "colwise"), ("k_proj", h, kv, "colwise"),
                                         ("v_proj", h, kv, "colwise"), ("o_proj", q, h, "rowwise")):  # fmt: skip
            specs += _linear(f"{p}.self_attn.{name}", n_in, n_out, desc, style, i)
        if desc.qk_norm:
            specs += [ParamSpec(f"{p}.self_attn.{n}.weight", (desc.head_dim,), block=i, role="head_norm")
                      for n in ("q_norm", "k_norm")]  # fmt: skip
        if e:
            # The layer is kept whole under tp (its router and experts run on every tp rank); ep splits experts.
            specs.append(ParamSpec(f"{p}.mlp.gate.weight", (e, h), block=i, role="router"))
            stacked = (("gate_up_proj", 2 * f),) if desc.gated_mlp else (("up_proj", f),)
            for proj, width in stacked:
                specs.append(ParamSpec(f"{p}.mlp.experts.{proj}", (e, width, h), expert_axis=0, block=i))
                if desc.bias:
                    specs.append(ParamSpec(f"{p}.mlp.experts.{proj}_bias", (e, width), expert_axis=0, block=i))
            specs.append(ParamSpec(f"{p}.mlp.experts.down_proj", (e, h, f), expert_axis=0, block=i))
            if desc.bias:
                specs.append(ParamSpec(f"{p}.mlp.experts.down_proj_bias", (e, h), expert_axis=0, block=i))
        else:
            for proj in ("gate_proj", "up_proj") if desc.gated_mlp else ("up_proj",):
                specs += _linear(f"{p}.mlp.{proj}", h, f, desc, "colwise", i)
            specs += _linear(f"{p}.mlp.down_proj", f, h, desc, "rowwise", i)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs += _norm(f"{p}.{norm}", desc, block=i, role="norm")
    specs += _norm("model.norm", desc, end="last")
    if not tied:
        specs.append(ParamSpec("lm_head.weight", (desc.vocab, h), end="last"))
    return specs


def _gpt2_specs(desc: ModelDesc) -> list[ParamSpec]:
    h, q, kv, f = desc.hidden, desc.heads * desc.head_dim, desc.kv_heads * desc.head_dim, desc.ffn
    tied = ("lm_head.weight",) if desc.tied_embeddings else ()
    specs = [ParamSpec("transformer.wte.weight", (desc.vocab, h), end="both" if tied else "first", tied_with=tied,
                       lookup=True)]  # fmt: skip
    if desc.learned_positions:
        specs.append(ParamSpec("transformer.wpe.weight", (desc.learned_positions, h), end="first", lookup=True))
    for i in range(desc.layers):
        p = f"transformer.h.{i}"
        # Conv1D stores [in, out]: the column split (fused [q | k | v], c_fc) is on dim 1, the row split on dim 0.
        for name, n_in, n_out, col in (("attn.c_attn", h, q + 2 * kv, True), ("attn.c_proj", q, h, False),
                                       ("mlp.c_fc", h, f, True), ("mlp.c_proj", f, h, False)):  # fmt: skip
            dim = 1 if col else 0
            specs.append(ParamSpec(f"{p}.{name}.weight", (n_in, n_out), tp_dim=dim, tp_row=not col, block=i))
            if desc.bias:
                specs.append(ParamSpec(f"{p}.{name}.bias", (n_out,), tp_dim=0 if col else None, block=i))
        specs += _norm(f"{p}.ln_1", desc, block=i, role="norm") + _norm(f"{p}.ln_2", desc, block=i, role="norm")
    specs += _norm("transformer.ln_f", desc, end="last")
    if not tied:
        specs.append(ParamSpec("lm_head.weight", (desc.vocab, h), end="last"))
    return specs


# ---- from a live module: the suite's own introspection -------------------------------------------------------------
def specs_from_module(module: nn.Module, *, tp_plan: Optional[dict[str, str]] = None) -> list[ParamSpec]:
    """The parameters of the user's own (unmodified) model, as the strategies will treat them.

    Uses the introspection the strategies run: `lightning_par.blocks.trunk.find_trunk` (blocks),
    `lightning_par.parallel.tensor.infer_tp_plan` (which projections tp splits, on which dim), `find_moe_layers`
    (experts and routers) and the pipeline's probe of what runs before and after the trunk
    (`lightning_par.parallel.pipeline.owners.find_ownership`). A model tensor parallelism cannot split gets no
    tensor-parallel dims (the strategies refuse ``tp > 1`` for it).

    Args:
        module: the model, before any strategy changed it; it may be on the meta device.
        tp_plan: the ``tp_plan=`` overrides the strategy will be given, if any.
    """
    from lightning_par.blocks.trunk import find_trunk
    from lightning_par.parallel.experts.finder import find_moe_layers
    from lightning_par.parallel.pipeline.owners import PipelineError, find_ownership

    trunk = find_trunk(module)
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    block_of: dict[str, int] = {}
    for i, block_name in enumerate(trunk.names if trunk is not None else ()):
        block_of.update({f"{block_name}.{n}": i for n, _ in module.get_submodule(block_name).named_parameters()})
    regions: dict[str, str] = {}
    dims, rows, roles = _tp_dims(module, trunk.names, tp_plan, regions) if trunk is not None else ({}, set(), {})
    experts, moe_roles = _expert_axes(module, find_moe_layers(module))
    roles.update(moe_roles)
    ends: dict[str, str] = {}
    lookups: set[str] = set()
    try:
        own = find_ownership(module, trunk) if trunk is not None else None
    except PipelineError:
        own = None  # a pipeline refuses this model (a block that runs again): no stage ends to tell
    calls: dict[str, tuple[int, ...]] = {}
    if own is not None and own.calls is not None:  # a block that runs more than once: the pipeline cuts its calls
        block_of = {}
        at: dict[str, list[int]] = {}
        for v, block_name in enumerate(own.calls.names):
            at.setdefault(block_name, []).append(v)
        for block_name, places in at.items():
            for n, _ in module.get_submodule(block_name).named_parameters():
                block_of[f"{block_name}.{n}"] = places[0]
                calls[f"{block_name}.{n}"] = tuple(places) if len(places) > 1 else ()
    if own is not None:
        ends.update({n: "every" for n in own.everywhere if n not in block_of})
        for units, end in ((own.pre, "first"), (own.post, "last")):
            for _, m in units:
                for sub in m.modules():
                    for p in sub.parameters(recurse=False):
                        key = names_of[id(p)][0]
                        ends[key] = "both" if ends.get(key, end) != end else end
                        if end == "first" and isinstance(sub, nn.Embedding):
                            lookups.add(key)
    specs = []
    for name, p in module.named_parameters():
        block = block_of.get(name)
        expert_axis, expert = experts.get(name, (None, None))
        specs.append(ParamSpec(
            name, tuple(p.shape), tp_dim=dims.get(name), tp_row=name in rows, expert_axis=expert_axis,
            expert=expert, block=block, end=None if block is not None else ends.get(name, "first"),
            tied_with=tuple(names_of[id(p)][1:]), lookup=name in lookups, role=roles.get(name, ""),
            trainable=p.requires_grad, calls=calls.get(name, ()), quantised=quantised_bytes(p),
            region=regions.get(name, ""),
        ))  # fmt: skip
    return specs


def quantised_bytes(p: nn.Parameter) -> Optional[tuple[int, int]]:
    """``(bytes, bytes every ZeRO-3 shard carries whole)`` of a parameter stored as a tensor subclass of other
    tensors (torchao's ``NF4Tensor``: 4-bit codes, scales, their double-quantised factors, all split by FSDP2 through
    torchao's all-gather extension, and a 16-value code book and a scale mean each shard carries whole); ``None`` for
    a plain or DTensor parameter."""
    from lightning_par.utils.dtensors import storages

    parts = storages(p)
    if len(parts) == 1:
        return None
    whole = sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in ("nf4", "scaler_mean") if hasattr(p, n))
    return sum(t.numel() * t.element_size() for t in parts), whole


def _tp_dims(
    module: nn.Module, block_names: tuple[str, ...], overrides: Optional[dict[str, str]], regions: dict[str, str]
) -> tuple[dict[str, int], set[str], dict[str, str]]:
    """Parameter name -> the dim tp splits, the row-parallel weights, and name -> role (``norm`` / ``head_norm``,
    the adapters of split bases), from the inferred plans: the trunk's, and each other stack's (an encoder's:
    `parallel.tensor.check.other_plans`; priced as split when it can be planned, before the checks on real values
    that could keep it whole). Fills ``regions``: parameter name -> the split region holding it."""
    from lightning_par.blocks.trunk import other_trunks
    from lightning_par.parallel.tensor.adapters import as_planned
    from lightning_par.parallel.tensor.plan import TPPlanError, infer_tp_plan

    try:
        with as_planned(module):  # as the strategies infer it (`compose._tp_plans`)
            plan = infer_tp_plan(module, overrides=overrides)
    except TPPlanError:
        return {}, set(), {}  # the strategies refuse tp > 1 for this model: every tensor stays whole
    plans = [(plan, block_names)]
    for stack in other_trunks(module, plan.trunk):
        mine = {k: v for k, v in (overrides or {}).items() if k.startswith(stack.path + ".")}
        try:
            plans.append((infer_tp_plan(module, overrides=mine, trunk=stack), stack.names))  # its blocks
        except TPPlanError:
            continue  # kept whole
    dims: dict[str, int] = {}
    rows: set[str] = set()
    roles: dict[str, str] = {}
    for each, names in plans:
        _plan_dims(module, each, names, dims, rows, roles, regions)
    return dims, rows, roles


def _plan_dims(
    module: nn.Module,
    plan: Any,
    block_names: tuple[str, ...],
    dims: dict[str, int],
    rows: set[str],
    roles: dict[str, str],
    regions: dict[str, str],
) -> None:
    from lightning_par.parallel.tensor.adapters import adapter_styles, dora_layers, find_adapters
    from lightning_par.parallel.tensor.plan_affine import affine

    star = f"{plan.trunk}.*" if plan.trunk else "*"
    groups = plan.groups.values() if plan.groups else [None]
    for sub, names in zip(plan.group_plans(), groups):
        blocks = names if names is not None else block_names
        split_heads = any(
            sub.styles.get(p) in ("colwise", "colwise_fused") for h in sub.heads.values() for p in h.projections
        )
        head_params = {q for h in sub.heads.values() for q in h.head_params} if split_heads else set()
        rel = {k[len(star) + 1 :]: v for k, v in sub.styles.items() if k.startswith(star + ".")}
        for block in blocks:
            # Low-rank adapters follow their bases (`parallel.tensor.adapters`): the split one of each pair, and DoRA's
            # magnitude with a column-split base's output rows.
            adapters = find_adapters(module.get_submodule(block))
            follows = {n: st for n, (st, _) in adapter_styles(rel, adapters).items()}
            for base in adapters:
                wrapper = base.rpartition(".")[0]
                if rel.get(base) in ("colwise", "colwise_fused"):
                    at = f"{wrapper}." if wrapper else ""
                    owner_of = module.get_submodule(f"{block}.{wrapper}" if wrapper else block)
                    follows.update({f"{at}lora_magnitude_vector.{k}": "colwise" for k in dora_layers(owner_of)})
            # Each split attention / MLP module, block-relative; the longest holding a parameter is its region.
            split = [
                i.region[len(star) + 1 :]
                for i in (*sub.heads.values(), *sub.mlps.values())
                if i.region.startswith(star + ".") and any(sub.styles.get(p) in _SPLIT for p in i.projections)
            ]
            for base, pairs in adapters.items():
                if rel.get(base) in _SPLIT:
                    roles.update(
                        {f"{block}.{n}.weight": r for a, b in pairs for n, r in ((a, "adapter_a"), (b, "adapter_b"))}
                    )
            for name, _ in module.get_submodule(block).named_parameters():
                owner, _, leaf = name.rpartition(".")
                holder = max((r for r in split if name.startswith(r + ".")), key=len, default=None)
                if holder is not None:
                    regions[f"{block}.{name}"] = f"{block}.{holder}"
                style = follows.get(owner) or sub.styles.get(f"{star}.{owner}" if owner else star)
                full = f"{block}.{name}"
                if f"{star}.{name}" in head_params:
                    dims[full] = 0  # per-head parameters (GPT-OSS's sinks) follow the heads
                    continue
                mod = module.get_submodule(f"{block}.{owner}" if owner else block)
                # A per-head table (T5's relative position bias, [buckets, heads]) splits its columns.
                table = isinstance(mod, nn.Embedding) and style == "colwise"
                dim = 1 if table else _style_dim(style, affine(mod), leaf)
                if dim is not None:
                    dims[full] = dim
                if style == "rowwise" and leaf == "weight":
                    rows.add(full)
                if style in ("sequence_parallel", "head_norm"):
                    roles[full] = "norm" if style == "sequence_parallel" else "head_norm"


_SPLIT = ("colwise", "colwise_fused", "rowwise")


def _style_dim(style: Optional[str], layout: object, leaf: str) -> Optional[int]:
    """The dim a style splits: a projection's output dim (column) or input dim (row), on its weight's layout."""
    transposed = bool(getattr(layout, "transposed", False))  # Conv1D: weight [in, out]
    if style in ("colwise", "colwise_fused"):
        return (1 if transposed else 0) if leaf == "weight" else 0
    if style == "rowwise":
        return (0 if transposed else 1) if leaf == "weight" else None  # the bias is added once, after the reduce
    if style == "colwise_norm":
        return 0
    return None


def _expert_axes(module: nn.Module, layers: list) -> tuple[dict[str, tuple[Optional[int], Optional[tuple[int, int]]]],
                                                          dict[str, str]]:  # fmt: skip
    """Parameter name -> (expert axis, whole-expert index) for the experts ep splits; routers' names -> "router"."""
    where = {id(m): n for n, m in module.named_modules()}
    axes: dict[str, tuple[Optional[int], Optional[tuple[int, int]]]] = {}
    roles: dict[str, str] = {}
    for layer in layers:
        prefix = where[id(layer.experts)]
        if layer.kind == "module_list":
            for i, expert in enumerate(layer.experts):
                for n, _ in expert.named_parameters():
                    axes[f"{prefix}.{i}.{n}"] = (None, (i, layer.n_experts))
        else:
            for n, _ in layer.experts.named_parameters():  # flat experts (DBRX) keep theirs one module down
                axes[f"{prefix}.{n}"] = (0, None)
        if layer.kind == "stacked" and layer.router is not None:
            router = where[id(layer.router)]
            roles.update({f"{router}.{n}": "router" for n, _ in layer.router.named_parameters()})
    return axes, roles
