"""Pipeline pieces without process groups: partitioner, trunk detection, the stage cut, schedules' rules, errors."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from _chained import chain_stages, summed_grads
from _job_models import DictTrunkLM, SeqTrunkLM, _Residual
from torch import nn

from lightning_par.analysis.pipeline_timeline import Action, one_f_one_b_order, replay
from lightning_par.blocks.trunk import find_trunk
from lightning_par.config import PP_SCHEDULES, ParallelConfig, ParallelConfigError
from lightning_par.models import GPT, Llama
from lightning_par.parallel.pipeline.partition import (
    PartitionError,
    even_split,
    measure_block_times,
    param_costs,
    partition,
    stage_costs,
)
from lightning_par.parallel.pipeline.schedule import (
    SCHEDULES,
    check_schedule,
    local_stages,
    n_stages,
    split_microbatches,
)
from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel, StageSpec

# ---- partitioner ---------------------------------------------------------------------------------------------


def _brute_force(
    costs: list[float], k: int, first: float, last: float, forbidden: frozenset[int] = frozenset()
) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations([c for c in range(1, n) if c not in forbidden], k - 1):
        bounds = [0, *cuts, n]
        ranges = list(itertools.pairwise(bounds))
        best = min(best, max(stage_costs(ranges, costs, first, last)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_partition_minimises_the_costliest_stage(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    costs = [float(c) for c in torch.randint(0, 10, (n,), generator=g)]
    first, last = float(torch.randint(0, 6, (1,), generator=g)), float(torch.randint(0, 6, (1,), generator=g))
    ranges = partition(costs, k, first_extra=first, last_extra=last)
    assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in itertools.pairwise(ranges))
    assert max(stage_costs(ranges, costs, first, last)) == _brute_force(costs, k, first, last)
    # Some cuts ruled out (a skip connection across them): the best among the others.
    forbidden = frozenset(c for c in range(1, n) if torch.rand((), generator=g) < 0.4)
    if n - 1 - len(forbidden) >= k - 1:
        ranges = partition(costs, k, first_extra=first, last_extra=last, forbidden=forbidden)
        assert not {a for a, _ in ranges[1:]} & forbidden and ranges[-1][1] == n
        assert max(stage_costs(ranges, costs, first, last)) == _brute_force(costs, k, first, last, forbidden)


def test_partition_gives_end_stages_fewer_blocks_when_embedding_and_head_cost() -> None:
    assert partition([1.0] * 8, 2) == [(0, 4), (4, 8)]
    # A head as costly as two blocks: the last stage takes two fewer blocks.
    assert partition([1.0] * 8, 2, last_extra=2.0) == [(0, 5), (5, 8)]
    ranges = partition([1.0] * 6, 3, first_extra=1.0, last_extra=1.0)
    assert ranges == [(0, 2), (2, 5), (5, 6)] and stage_costs(ranges, [1.0] * 6, 1.0, 1.0) == [3.0, 3.0, 2.0]


def test_manual_split_and_its_errors() -> None:
    assert partition([1.0] * 5, 2, split=[1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(PartitionError, match=r"pp_split=\[2, 2\] must be 2 positive block counts .* 5 blocks"):
        partition([1.0] * 5, 2, split=[2, 2])
    with pytest.raises(PartitionError, match=r"e\.g\. pp_split=\[3, 2\]"):
        partition([1.0] * 5, 2, split=[5, 0])
    assert even_split(5, 2) == [3, 2]


def test_more_stages_than_blocks_is_rejected_with_the_fix() -> None:
    with pytest.raises(PartitionError, match=r"4 pipeline stages but the trunk has only 3 blocks.*<= 3"):
        partition([1.0] * 3, 4)
    with pytest.raises(PipelineError, match=r"needs 4 stages but the trunk has 2 blocks.*'1f1b' or a smaller pp"):
        check_schedule("interleaved_1f1b", 2, 4, 2)


def test_costs_from_parameters_and_measured_times() -> None:
    model = GPT(n_layer=3, n_embd=32, n_head=4)
    blocks = find_trunk(model).blocks
    assert param_costs(blocks) == [float(sum(p.numel() for p in blocks[0].parameters()))] * 3
    times = measure_block_times(blocks, torch.randn(2, 8, 32), repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    # Llama blocks take the rotary table as a second argument.
    llama = Llama(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8)
    assert len(measure_block_times(find_trunk(llama).blocks, torch.randn(1, 8, 32), llama.rope[:8], repeats=1)) == 2


# ---- trunk detection -------------------------------------------------------------------------------------------


def test_trunk_detection_for_list_sequential_and_dict_trunks_with_extra_block_args() -> None:
    assert find_trunk(GPT(n_layer=2)).names == ("transformer.h.0", "transformer.h.1")
    # Llama's blocks take (x, rope): the trunk does not depend on the blocks' signatures.
    assert find_trunk(Llama(n_layers=3, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64)).path == "layers"
    seq = find_trunk(SeqTrunkLM())
    assert seq is not None and seq.path == "trunk" and seq.names == tuple(f"trunk.{i}" for i in range(4))
    dct = find_trunk(DictTrunkLM())  # blocks take (x, scale), the scale computed before the trunk
    assert dct is not None and dct.path == "blocks" and dct.names == tuple(f"blocks.b{i}" for i in range(4))


# ---- the stage cut, run by hand in one process -----------------------------------------------------------------


def _models() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "gpt": GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32),
        "llama": Llama(vocab_size=64, max_seq_len=16, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64),
        "seq": SeqTrunkLM(),
        "dict": DictTrunkLM(),
    }


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


class _OneTable(nn.Module):
    """The embedding table doubles as the head, read functionally after the trunk (``h @ self.emb.weight.T``):
    one module used on both sides of the trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_Residual(32) for _ in range(4))
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.norm(h) @ self.emb.weight.T


def _family(name: str) -> Any:
    import _families

    torch.manual_seed(0)
    return getattr(_families, name)()


FAMILIES = ("LitGPTPythia", "LitGPTLlama", "HFGPT2", "HFQwen2Tied", "HFViT")


@pytest.mark.parametrize("name", ["gpt", "llama", "seq", "dict", "gpt_tied", "one_table", *FAMILIES])
def test_stages_chained_by_hand_give_the_full_model_loss_and_gradients(name: str) -> None:

    if name in FAMILIES:
        full = _family(name)
        loss_of: Any = lambda m, b: m._loss(b)  # noqa: E731  (the user's own loss)
    else:
        torch.manual_seed(0)
        tied_gpt = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, tie_weights=True)
        full = {"gpt_tied": tied_gpt, "one_table": _OneTable()}.get(name) or _models()[name]
        loss_of = _loss
    vocab = 64 if name in ("gpt", "llama", "gpt_tied", "one_table") else 256
    seq = 16 if vocab == 64 else 32  # the ViT reads (x, y) as one 8 x 8 image
    batch = (torch.randint(0, vocab, (2, seq)), torch.randint(0, vocab, (2, seq)))
    ref = loss_of(full, batch)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    ranges = [(0, 1), (1, 3), (3, 4)]
    # Each stage on its own "rank": its own cut copy of the model; activation, then activation, then the loss.
    outs, cuts, pipes = chain_stages(full, ranges, lambda m: loss_of(m, batch))
    hidden = outs[-1]
    torch.testing.assert_close(hidden, ref, rtol=1e-6, atol=0)
    # In one process the stages' graphs are chained, so one backward reaches every stage's parameters.
    hidden.backward()
    held = [(n, p.grad) for m in cuts for n, p in m.named_parameters()]
    got = dict(held)
    tied = pipes[0].ownership.tied
    assert bool(tied) == (name in ("gpt_tied", "one_table", "HFGPT2", "HFQwen2Tied"))
    for names in tied:  # the first and the last stage each hold a copy: their gradients sum to the model's
        copies = [g for n, g in held if n in names]
        assert len(copies) == 2
        for n in names:
            got.pop(n, None)
        got[names[0]] = copies[0] + copies[1]
    assert len(held) == len(got) + len(tied)  # no other parameter is held twice
    assert set(got) == set(ref_grads)  # every parameter is owned by exactly one stage, under its original name
    for n, g in ref_grads.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=lambda msg, n=n: f"{n}: {msg}")


def test_stage_keeps_only_its_parameters_and_fakes_the_embedding() -> None:
    model = _models()["gpt"]
    pipe = PipelineModel(model, find_trunk(model), [(0, 2), (2, 4)], [1], torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    assert all(n.startswith(("transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head")) for n in names)
    assert pipe.pre_names == ["transformer.wte", "transformer.wpe"] and pipe.post_names == ["transformer.ln_f",
                                                                                            "lm_head"]  # fmt: skip
    pipe.install()
    received = torch.randn(2, 8, 32, requires_grad=True)
    pipe.begin_step(lambda _mb, _spec: _loss(model, (torch.zeros(2, 8, dtype=torch.long),) * 2))
    loss = pipe.run_stage(pipe.specs[0], received, 0)
    loss.backward()
    assert received.grad is not None and received.grad.abs().sum() > 0  # the stage differentiates its input


def test_model_outside_the_pipeline_and_broken_contracts_fail_clearly() -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _models()["gpt"]
    PipelineModel(model, find_trunk(model), [(0, 2), (2, 4)], [0], torch.device("cpu")).install()
    with pytest.raises(RuntimeError, match=r"transformer.h.0 was called outside the pipeline"):
        model(torch.zeros(1, 4, dtype=torch.long))

    class RootParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * self.scale  # before the trunk (on every stage: it is no unit's)
            for block in self.blocks:
                x = block(x)
            return x * self.scale  # and after it

    # Once refused ("move it into a submodule", a change to the model): every stage now holds such a parameter, a
    # stage's own too (a zero-bubble schedule's weight pass computes its gradient), summed over the pipeline.
    root = RootParam()
    root.example_input_array = torch.zeros(1, 4)
    own = find_ownership(root, find_trunk(root))
    assert own.everywhere == ("scale",)
    cut = PipelineModel(root, find_trunk(root), [(0, 1), (1, 2)], [1], torch.device("cpu"), own)
    assert any(p is root.scale for p in cut.stage_modules()[0].parameters())


class _HeadFirst(nn.Module):
    """Registers its head and final norm before the embedding and the blocks (litgpt's GPT does so too)."""

    def __init__(self, tokens: bool = True, between: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(8)
        self.unused = nn.Linear(8, 8)
        self.emb = nn.Embedding(16, 8) if tokens else nn.Linear(3, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.between and i == 0:
                h = self.norm(h)
        return self.head(self.norm(h))


def test_ownership_follows_what_runs_before_and_after_the_trunk() -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _HeadFirst()
    own = find_ownership(model, find_trunk(model))
    # Never-run modules stay with the first stage (and in its checkpoints).
    assert own.source == "probe" and [n for n, _ in own.pre] == ["unused", "emb"]
    assert [n for n, _ in own.post] == ["head", "norm"] and own.tied == []
    lit = _family("LitGPTPythia").model  # lm_head registered before transformer.wte
    lit_own = find_ownership(lit, find_trunk(lit))
    assert [n for n, _ in lit_own.pre] == ["transformer.wte"]
    assert [n for n, _ in lit_own.post] == ["lm_head", "transformer.ln_f"]
    tied = GPT(n_layer=2, tie_weights=True)  # one weight, two modules: each placed by its own calls
    tied_own = find_ownership(tied, find_trunk(tied))
    assert [n for n, _ in tied_own.pre] == ["transformer.wte", "transformer.wpe"]
    assert tied_own.tied == [("transformer.wte.weight", "lm_head.weight")]
    # A forward the probe cannot call (float inputs of 3 features): registration order, and the reason kept.
    floats = _HeadFirst(tokens=False)
    fallback = find_ownership(floats, find_trunk(floats))
    assert fallback.source == "registration order" and "Error" in fallback.reason
    assert [n for n, _ in fallback.pre] == ["head", "norm", "unused", "emb"] and fallback.post == []
    floats.example_input_array = torch.zeros(2, 3)  # Lightning's convention: then the probe runs
    assert [n for n, _ in find_ownership(floats, find_trunk(floats)).post] == ["head", "norm"]
    between = _HeadFirst(between=True)
    with pytest.raises(PipelineError, match=r"norm runs between the trunk's blocks \(blocks\)"):
        find_ownership(between, find_trunk(between))


class _BatchWrapper(nn.Module):
    """A LightningModule-style wrapper whose forward wants the batch dict, around a model that registers its head
    first, plus a module of its own registered after the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _HeadFirst()
        self.extra = nn.Linear(16, 16)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.extra(self.model(batch["ids"]))


def test_ownership_probes_the_wrapped_model_when_the_wrapper_cannot_be_called() -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    wrapper = _BatchWrapper()
    own = find_ownership(wrapper, find_trunk(wrapper))
    # The wrapper's forward fails on token ids; the model holding the trunk is probed instead, so its head goes to
    # the last stage although it is registered first. The wrapper's own module keeps registration order.
    assert own.source == "probe"
    assert [n for n, _ in own.pre] == ["model.unused", "model.emb"]
    assert [n for n, _ in own.post] == ["model.head", "model.norm", "extra"]
    wrapper.model.emb = nn.Linear(3, 8)  # now neither can be called on token ids: registration order, both reasons
    fallback = find_ownership(wrapper, find_trunk(wrapper))
    assert fallback.source == "registration order" and "the probe of model:" in fallback.reason


class _SideOutputs(nn.Module):
    """Each block's hidden state is kept, and a penalty on all of them is added after the trunk (as Hugging Face
    MoE models add a load-balancing loss over every layer's router logits)."""

    def __init__(self, penalty: bool = True) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Residual(8) for _ in range(4))
        self.penalty = penalty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, kept = self.emb(x), []
        for block in self.blocks:
            h = block(h)
            kept.append(h)
        out = self.head(h)
        return out + torch.stack(kept).mean() if self.penalty else out


def test_a_tensor_made_inside_the_trunk_and_read_after_it_rules_out_every_cut_before_its_reader() -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _SideOutputs()
    # The last block's output is handed on (and allowed); block 0's is not, so no cut keeps the values.
    own = find_ownership(model, find_trunk(model))
    assert sorted(own.cut_conflicts) == [1, 2, 3]
    assert own.cut_conflicts[1].startswith("the code after the trunk reads, in stack(), a value blocks.0 computed")
    message = r"cannot cut the trunk before blocks\.2: the code after the trunk reads, in stack\(\), a value blocks\.0"
    with pytest.raises(PipelineError, match=message + r" computed.*No cut of this trunk"):
        PipelineModel(model, find_trunk(model), [(0, 2), (2, 4)], [0], torch.device("cpu"))
    plain = _SideOutputs(penalty=False)
    assert find_ownership(plain, find_trunk(plain)).cut_conflicts == {}


def _carrying(name: str) -> Any:
    from _families import HFT5
    from _rel_bias_models import RelBiasLM

    torch.manual_seed(0)
    return {"rel_bias": RelBiasLM, "t5": HFT5}[name]()


# What crosses the cut besides the hidden state: (kind, block, path, leaf) of each slot.
CARRIED = {
    # The bias block 0 makes and returns (leaf 1), which the loop hands to block 1, and block 1 to block 2.
    "rel_bias": [("returned", 0, "", 1), ("returned", 1, "", 1)],
    # The encoder's output (its final norm's, first-stage modules) that every decoder block reads, and the self- and
    # cross-attention biases decoder block 0 returns (leaves 1 and 2 of its (hidden, bias, bias)).
    "t5": [("before", -1, "model.encoder.final_layer_norm", 0), ("returned", 0, "", 1), ("returned", 0, "", 2)],
}


@pytest.mark.parametrize("name", list(CARRIED))
def test_what_a_block_returns_and_first_stage_outputs_read_later_travel_across_the_cut(name: str) -> None:
    # Once refused ("No cut of this trunk keeps the values"): such values now cross the boundary with the hidden
    # state, and the stages chained by hand give the whole model's loss and gradients.

    from lightning_par.parallel.pipeline.owners import find_ownership

    full = _carrying(name)
    own = find_ownership(full, find_trunk(full))
    assert own.cut_conflicts == {}
    assert [(s.kind, s.block, s.path, s.leaf) for s in own.sides] == CARRIED[name]
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))

    def loss(m: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())

    ref = loss(full)
    ref.backward()
    ranges = [(0, 1), (1, len(find_trunk(full).names))]
    outs, cuts, _ = chain_stages(full, ranges, loss)
    # Stage 0 sends the hidden state, then the first-stage outputs and what block 0 returns (not block 1's).
    crossing = [c for c in CARRIED[name] if c[0] == "before" or c[1] == 0]
    assert isinstance(outs[0], tuple) and len(outs[0]) == 1 + len(crossing)
    out = outs[-1]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    out.backward()
    got = summed_grads(cuts, own.tied)  # T5's shared embedding is also its head: on both end stages
    for n, p in full.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda msg, n=n: f"{n}: {msg}")


def _skip_lm(mode: str) -> Any:
    from _job_models import SkipLM

    torch.manual_seed(0)
    return SkipLM(mode)


# mode -> the cuts that keep the one-process values (tests/_job_models.py's SkipLM)
SKIP_CUTS = {"unet": [], "groups": [3], "x0": [], "outside": [], "late_read": [1, 2, 3]}


@pytest.mark.parametrize("mode", list(SKIP_CUTS))
def test_values_that_reach_past_a_cut_other_than_through_the_hidden_state_rule_that_cut_out(mode: str) -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _skip_lm(mode)
    trunk = find_trunk(model)
    own = find_ownership(model, trunk)
    assert [c for c in range(1, 6) if c not in own.cut_conflicts] == SKIP_CUTS[mode]
    first = min(own.cut_conflicts)
    expected = {
        "unet": r"the code between blocks\.4 and blocks\.5 reads, in add\(\), a value blocks\.0 computed, which a "
                r"stage starting at blocks\.1 does not have",
        "groups": r"the code between blocks\.1 and blocks\.2 reads, in add\(\), a value blocks\.0 computed",
        "x0": r"blocks\.1 is called with a tensor made by add\(\) in the code between blocks\.0 and blocks\.1 "
              r"instead of what blocks\.0 returned",
        "outside": r"blocks\.1 is called with a tensor made by add\(\) in the code between blocks\.0 and blocks\.1",
        "late_read": r"the code after the trunk reads, in add\(\), a value blocks\.3 computed, which a stage starting "
                     r"at blocks\.4 does not have",
    }[mode]  # fmt: skip
    assert re.match(expected, own.cut_conflicts[first]), own.cut_conflicts[first]
    # A split at a ruled-out cut is refused before any step, naming the reader and a split that is exact.
    bad = next(c for c in range(1, 6) if c in own.cut_conflicts and c != 3)
    fix = {
        "groups": r"Cut only before blocks \[3\] \(e\.g\. pp_split=\(3, 3\)",
        "late_read": r"Cut only before blocks \[1, 2, 3\] \(e\.g\. pp_split=\(3, 3\)",
    }.get(
        mode, r"No cut of this trunk keeps the values: train without pipeline parallelism \(e\.g\. strategy='zero3'\)"
    )
    with pytest.raises(PipelineError, match=rf"cannot cut the trunk before blocks\.{bad}: .*{fix}"):
        PipelineModel(_skip_lm(mode), trunk, [(0, bad), (bad, 6)], [0], torch.device("cpu"), own)


class _RopeBlock(nn.Module):
    """Moves a table made before the trunk to its input's device, as Llama-4's attention does with its rotary
    table (``position_embeddings.to(query_states.device)``): on the device it is on, ``.to()`` hands it back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return h + self.fc(h) * table.to(h.device).contiguous()


class _RopeLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(_RopeBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(x.shape[1], dtype=torch.float32)[:, None].cos()  # from the batch's shape alone
        h = self.emb(x)
        for block in self.blocks:
            h = block(h, table)
        return h


def test_a_call_that_hands_back_what_it_read_makes_no_value_of_the_block_it_runs_in() -> None:
    # Found by the zoo sweep: Llama-4 text was refused under pipe ("layers.1.self_attn reads, in to(), a value
    # layers.0.self_attn computed"), since block 0's no-op `.to()` re-based the table every stage computes itself.
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _RopeLM()
    assert find_ownership(model, find_trunk(model)).cut_conflicts == {}


@pytest.mark.parametrize("mode", ["groups", "late_read"])
def test_the_automatic_split_keeps_to_the_cuts_that_keep_the_values(mode: str) -> None:
    import copy

    from lightning_par.parallel.pipeline.owners import find_ownership

    full = _skip_lm(mode)
    own = find_ownership(full, find_trunk(full))
    ranges = partition([1.0] * 6, 2, forbidden=own.cut_conflicts)
    assert ranges == [(0, 3), (3, 6)]  # the balanced cut is allowed in both
    assert partition([1.0] * 6, 2, last_extra=4.0, forbidden=own.cut_conflicts) == [(0, 3), (3, 6)]  # not (0, 5)
    batch = (torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    ref = full._loss(*batch)
    ref.backward()
    cuts = [copy.deepcopy(full) for _ in ranges]
    for m in cuts:
        m.zero_grad(set_to_none=True)
    hidden = None
    for s, m in enumerate(cuts):
        pipe = PipelineModel(m, find_trunk(m), ranges, [s], torch.device("cpu"))
        pipe.install()
        pipe.begin_step(lambda _mb, _spec, m=m: m._loss(*batch))
        hidden = pipe.run_stage(pipe.specs[0], hidden, 0)
    torch.testing.assert_close(hidden, ref, rtol=1e-6, atol=0)
    hidden.backward()
    got = {n: p.grad for m in cuts for n, p in m.named_parameters()}
    assert set(got) == {n for n, _ in full.named_parameters()}
    for n, p in full.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda msg, n=n: f"{n}: {msg}")


def test_no_split_into_more_stages_than_the_allowed_cuts_allow() -> None:
    from lightning_par.parallel.pipeline.cuts import no_split_possible
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _skip_lm("groups")
    trunk = find_trunk(model)
    own = find_ownership(model, trunk)
    assert no_split_possible(own.cut_conflicts, trunk.names, 2) is None
    why = no_split_possible(own.cut_conflicts, trunk.names, 3)
    assert why is not None and "Only 1 cut(s) keep the values (before blocks [3]): use at most 2 pipeline stages" in why
    with pytest.raises(PartitionError, match=r"3 pipeline stages need 2 cuts but only 1 .* use at most 2 stages"):
        partition([1.0] * 6, 3, forbidden=own.cut_conflicts)


def test_a_stage_reads_the_attribute_tree_of_modules_it_does_not_own() -> None:
    vit = _family("HFViT")
    pipe = PipelineModel(vit, find_trunk(vit), [(0, 2), (2, 4)], [1], torch.device("cpu"))
    emb = vit.model.vit.embeddings  # owned by stage 0: a meta copy of the whole subtree stands in
    weight = emb.patch_embeddings.projection.weight
    assert type(emb).__name__ == "ViTEmbeddings" and emb.patch_embeddings.num_patches == 16
    assert weight.device.type == "meta" and weight.dtype == torch.float32 and weight.shape == (32, 1, 2, 2)
    assert emb.cls_token.shape == (1, 1, 32) and vit.model.config.hidden_size == 32
    names = [n for n, _ in vit.named_parameters()]
    assert names and not any(".embeddings." in n for n in names)  # no optimizer, checkpoint or ZeRO sees them
    assert not any(".embeddings." in k for k in vit.state_dict())
    vit.to(torch.float64)  # Lightning's dtype and device moves leave the stand-in alone
    assert emb.patch_embeddings.projection.weight.dtype == torch.float32
    vit.to(torch.float32)
    pipe.install()
    received = torch.randn(2, 17, 32, requires_grad=True)  # 16 patches + the class token
    pipe.begin_step(lambda _mb, _spec: vit._loss((torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))))
    loss = pipe.run_stage(pipe.specs[0], received, 0)  # ViTModel.forward reads the projection's dtype first
    loss.backward()
    assert received.grad is not None and received.grad.abs().sum() > 0
    # The last stage's modules, on the first stage: readable, and calling them names the module and the fix.
    first = _family("HFViT")
    PipelineModel(first, find_trunk(first), [(0, 2), (2, 4)], [0], torch.device("cpu"))
    assert first.model.classifier.weight.shape == (16, 32) and first.model.classifier.weight.is_meta
    with pytest.raises(PipelineError, match=r"model.classifier belongs to the last pipeline stage \(it ran after "
                                            r"the trunk .*example_input_array"):  # fmt: skip
        first.model.classifier(torch.zeros(1, 32))


def test_stage_that_skips_its_last_block_is_reported() -> None:
    model = _models()["gpt"]
    pipe = PipelineModel(model, find_trunk(model), [(0, 2), (2, 4)], [0], torch.device("cpu"))
    pipe.install()
    pipe.begin_step(lambda _mb, _spec: torch.zeros(()))  # never calls the model
    with pytest.raises(PipelineError, match=r"stage 0 finished without running block transformer.h.1"):
        pipe.run_stage(StageSpec(0, 0, 2, True, False), None, 0)


# ---- schedules, microbatches, config -----------------------------------------------------------------------------


def test_stage_to_rank_maps() -> None:
    assert local_stages("1f1b", 4, 1) == [1]
    assert local_stages("interleaved_1f1b", 2, 0) == [0, 2] and local_stages("looped_bfs", 2, 1) == [1, 3]
    assert local_stages("zbv", 2, 0) == [0, 3] and local_stages("dualpipev", 4, 1) == [1, 6]
    assert n_stages("interleaved_zb", 4) == 8 and n_stages("gpipe", 4) == 4
    assert set(SCHEDULES) == set(PP_SCHEDULES)
    # vpp: any number of stages per rank under the looped interleaved schedules (Megatron's virtual pipeline size).
    assert local_stages("interleaved_1f1b", 2, 1, vpp=3) == [1, 3, 5] and n_stages("looped_bfs", 4, vpp=4) == 16


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "message"),
    [
        ("dualpipev", 2, 3, r"'dualpipev' needs microbatches >= 4 \(pp x 2 virtual stages\).*microbatches=4"),
        ("interleaved_1f1b", 4, 9, r"multiple of max\(1, microbatches // pp\) = 2; got 9: use a multiple of pp=4"),
        ("1f1b", 4, 3, r"'1f1b' needs microbatches >= 4 stages; got 3"),
        ("interleaved_1f1b:5", 4, 8, r"pp=4 with pp_schedule='interleaved_1f1b' and vpp=5 needs 20 stages but the "
                                     r"trunk has 16 blocks .*; use vpp <= 4"),
    ],
)
def test_schedule_rules_are_checked_up_front(schedule: str, pp: int, m: int, message: str) -> None:
    name, _, vpp = schedule.partition(":")
    with pytest.raises(PipelineError, match=message):
        check_schedule(name, pp, m, 16, int(vpp) if vpp else None)


def test_microbatches_split_tensors_tuples_and_dicts_along_dim_0() -> None:
    batch = {"x": torch.arange(8).view(4, 2), "y": (torch.arange(4), "tag"), "n": torch.tensor(3.0)}
    mbs = split_microbatches(batch, 2)
    assert len(mbs) == 2 and mbs[1]["x"].tolist() == [[4, 5], [6, 7]] and mbs[0]["y"][0].tolist() == [0, 1]
    assert mbs[0]["y"][1] == "tag" and float(mbs[1]["n"]) == 3.0
    assert [t.tolist() for t in split_microbatches(torch.arange(6), 3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(PipelineError, match=r"batch size per data-parallel rank \(6\) is not divisible by "
                                            r"microbatches=4; choose microbatches in \{1, 2, 3, 6\}"):  # fmt: skip
        split_microbatches((torch.zeros(6), torch.zeros(6)), 4)
    with pytest.raises(PipelineError, match=r"differ in size along dim 0 \(\[3, 4\]\)"):
        split_microbatches((torch.zeros(4), torch.zeros(3)), 2)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (
            {"pp": 2, "pp_schedule": "zbv", "activation_checkpointing": "selective_op"},
            ParallelConfigError,
            r"'selective_op' cannot run under pp_schedule='zbv'.*'full'",
        ),
        ({"pp_split": (2, 0)}, ParallelConfigError, r"pp_split=\(2, 0\) must be positive block counts"),
        ({"pp": 2, "pp_schedule": "zbv", "vpp": 3}, ParallelConfigError,
         r"vpp=3 sets the stages per rank of a looped interleaved schedule \(interleaved_1f1b, looped_bfs, "
         r"interleaved_zb\).*pp_schedule='zbv' runs 2\); drop vpp"),
        ({"pp": 2, "pp_schedule": "1f1b", "vpp": 2}, ParallelConfigError, r"pp_schedule='1f1b' runs 1\); drop vpp"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b", "vpp": 1}, ParallelConfigError, r"an int >= 2"),
        ({"pp_costs": (1.0, -1.0)}, ParallelConfigError, r"pp_costs=.* must be >= 0"),
    ],
)
def test_pipeline_config_errors(kwargs: dict[str, Any], exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        ParallelConfig(**kwargs).check_supported()


@pytest.mark.parametrize(
    "name", ["pipe", "pipe_zero1", "pipe_zero2", "pipe_zero3", "pipe_tp", "3d", "pipe_tp_zero2", "pipe_tp_zero3"]
)
def test_pipe_names_construct(name: str) -> None:
    from lightning_par.strategies.registry import strategy_kwargs

    kwargs = strategy_kwargs(name)
    assert kwargs["auto_dims"][0] == "pp"
    import lightning_par

    lightning_par.ParallelStrategy(**kwargs)  # validated at construction; degrees come from the world size


def test_split_is_described_for_the_start_up_log() -> None:
    from lightning_par.parallel.pipeline.schedule import PipelineRunner

    model = _models()["gpt"]
    pipe = PipelineModel(model, find_trunk(model), [(0, 1), (1, 4)], [0], torch.device("cpu"))
    runner = PipelineRunner.__new__(PipelineRunner)  # describe() needs no process group
    runner.model, runner.schedule_name, runner.pp, runner.microbatches = pipe, "1f1b", 2, 4
    assert runner.describe() == (
        "pipeline 1f1b, 2 stages over pp=2, 4 microbatches; stage 0: transformer.h.0..transformer.h.0; stage 1: "
        "transformer.h.1..transformer.h.3; before the trunk ['transformer.wte', 'transformer.wpe'] on stage 0, after "
        "it ['transformer.ln_f', 'lm_head'] on the last"
    )
    tied = GPT(n_layer=2, tie_weights=True)
    runner.model = PipelineModel(tied, find_trunk(tied), [(0, 1), (1, 2)], [1], torch.device("cpu"))
    assert runner.describe().endswith("on the last; tied ['transformer.wte.weight'] held by both")


# ---- the bubble a schedule has by construction (analysis/pipeline_timeline.py; used by benchmarks/) ------------
def _interleaved_table(p: int, m: int, v: int = 2) -> dict[int, list[Any]]:
    # torch builds the table in __init__ from a few attributes; the stages themselves are not needed.
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, m // p)
    ns = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds)
    return {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, r) for r in range(p)}


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_replayed_tables_give_the_textbook_bubbles(p: int, k: int) -> None:
    m = k * p
    one_f_one_b = replay(one_f_one_b_order(p, m), 1.0, 1.0, 1.0)
    assert one_f_one_b.bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    # Unequal costs: the fill and drain are still p - 1 slots of (f + b + w), the work m of them.
    assert replay(one_f_one_b_order(p, m), 1.0, 2.0, 0.5).makespan == pytest.approx((m + p - 1) * 3.5)
    interleaved = replay(_interleaved_table(p, m), 0.5, 0.5, 0.5)  # v = 2: each virtual stage does half the work
    assert interleaved.bubble == pytest.approx((p - 1) / (2 * m + p - 1), rel=1e-12)
    assert all(b == pytest.approx(3.0 * m) for b in interleaved.busy.values())  # m x v x (f + b + w)


def test_one_f_one_b_order_holds_at_most_p_microbatches_and_runs_each_once() -> None:
    p, m = 4, 8
    for r, acts in one_f_one_b_order(p, m).items():
        assert sorted((a.computation_type, a.microbatch_index) for a in acts) == sorted(
            (kind, i) for kind in "FB" for i in range(m)
        )
        in_flight = peak = 0
        for a in acts:
            in_flight += 1 if a.computation_type == "F" else -1
            peak = max(peak, in_flight)
        assert peak == p - r


def test_replay_names_the_action_a_broken_table_waits_on() -> None:
    table = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 1), Action(1, "B", 1)]}
    with pytest.raises(ValueError, match=r"cannot progress: next actions \{0: .*1: "):
        replay(table, 1.0, 1.0, 1.0)


def test_step_trace_times_actions_and_waits_and_the_timeline_draws_them() -> None:
    import time

    import numpy as np

    from lightning_par import _compat
    from lightning_par.callbacks.pictures import pipeline_timeline
    from lightning_par.parallel.pipeline.trace import StepTrace

    class Stage:  # the three action methods a torch PipelineStage has, each taking 10 ms
        stage_index = 1

        def forward_one_chunk(self, chunk: int, args: Any = None) -> None:
            time.sleep(0.01)

        def backward_one_chunk(self, chunk: int, loss: Any = None, full_backward: bool = True) -> None:
            time.sleep(0.01)

        def backward_weight_one_chunk(self, chunk: int) -> None:
            time.sleep(0.01)

    trace, stage = StepTrace(), Stage()
    trace.watch(stage)
    stage.forward_one_chunk(0)  # outside a step: not recorded
    assert trace.last is None
    with trace:
        stage.forward_one_chunk(0)
        _compat.pipeline_p2p_wait()([])  # what torch's schedules call: timed as waiting
        stage.backward_one_chunk(0, full_backward=False)
        stage.backward_weight_one_chunk(0)
        stage.backward_one_chunk(1)
    record = trace.last
    assert record is not None
    assert [(s.kind, s.stage, s.microbatch) for s in record.spans] == [
        ("F", 1, 0), ("wait", -1, -1), ("I", 1, 0), ("W", 1, 0), ("B", 1, 1)
    ]  # fmt: skip
    assert all(a.end <= b.start for a, b in itertools.pairwise(record.spans))
    assert record.spans[-1].end <= record.duration and record.duration >= 0.04
    assert record.waiting == record.spans[1].end - record.spans[1].start
    assert record.bubble == record.waiting / record.duration
    picture = pipeline_timeline([record, record])
    assert picture.dtype == np.uint8 and picture.shape[2] == 3
    colours = {tuple(c) for c in picture.reshape(-1, 3).tolist()}
    assert {(66, 133, 244), (52, 168, 83), (251, 140, 0)} <= colours


class _Counted(nn.Module):
    """A block that returns its hidden state and a count read from the values (``.item()``): no meta-device forward
    can give the count, so a stage that starts after it could not stand in for it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        h = h + self.fc(h)
        return h, n + int((h > 0).sum().item())


class _CountedLM(nn.Module):
    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Counted() if counted else _Merge8() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, n = self.emb(x), 0
        for block in self.blocks:
            h, n = block(h, n)
        return self.head(h)


class _Merge8(nn.Module):
    """Halves the sequence (two tokens into one) and returns the new length: a shape its stand-in must give."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, h: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        return self.fc(h.reshape(h.shape[0], -1, 16)), n + 1


def test_a_block_whose_output_no_stand_in_can_give_rules_out_the_cuts_after_it() -> None:
    from lightning_par.parallel.pipeline.owners import find_ownership

    model = _CountedLM(counted=True)
    own = find_ownership(model, find_trunk(model))
    assert own.reshaped == (0, 1)  # the last block needs no stand-in: no stage starts after it
    assert sorted(own.cut_conflicts) == [1, 2]
    assert re.match(r"blocks\.0 returns tuple, not a tensor of its input's shape, .*meta-device forward, which fails",
                    own.cut_conflicts[1])  # fmt: skip
    with pytest.raises(PipelineError, match=r"cannot cut the trunk before blocks\.1: blocks\.0 returns tuple"):
        PipelineModel(model, find_trunk(model), [(0, 1), (1, 3)], [1], torch.device("cpu"))
    merging = _CountedLM(counted=False)
    own = find_ownership(merging, find_trunk(merging))
    assert own.reshaped == (0, 1) and own.cut_conflicts == {}


def test_a_stand_in_hands_on_the_blocks_structure_shapes_and_plain_values() -> None:
    # A stage starting at block 2 runs blocks 0 and 1 as stand-ins: the loop unpacks (hidden, length) from each, and
    # the walk gives the shape entering every block (what a stage starting there receives).
    torch.manual_seed(0)
    model = _CountedLM(counted=False)
    trunk = find_trunk(model)
    cut = PipelineModel(model, trunk, [(0, 2), (2, 3)], [1], torch.device("cpu"))
    cut.install()
    x = torch.zeros(2, 8, dtype=torch.long)
    seen = cut.walk(lambda: model(x))
    assert [tuple(t.shape) for t in seen] == [(2, 8, 8), (2, 4, 8), (2, 2, 8)]
