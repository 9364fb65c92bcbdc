"""Activation checkpointing recomputes whole blocks, keeps parameter names, and leaves gradients unchanged."""

from __future__ import annotations

import pytest
import torch

from lightning_par.models import GPT, Llama
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_par.plans.trunk import find_trunk


def _grads(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [lambda: GPT(n_layer=4, n_embd=32), lambda: Llama(n_layers=4, dim=32)])
@pytest.mark.parametrize(("mode", "expected"), [("full", [0, 1, 2, 3]), ("selective", [0, 2]), (None, [])])
def test_checkpointing_recomputes_blocks_and_keeps_gradients(make, mode, expected):
    torch.manual_seed(0)
    model = make()
    x = torch.randint(0, 256, (2, 16))
    before = _grads(model, x)
    names = [n for n, _ in model.named_parameters()]
    trunk = find_trunk(model)
    assert trunk is not None and len(trunk.blocks) == 4
    calls = [0] * 4
    for i, block in enumerate(trunk.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        # Count executions of the block's body (the hook above only sees __call__).
        inner = block.forward

        def counted(*args, _inner=inner, _i=i, **kwargs):
            calls[_i] += 10
            return _inner(*args, **kwargs)

        block.forward = counted
    assert apply_activation_checkpointing(trunk.blocks, mode, every=2) == expected
    after = _grads(model, x)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    for n in names:
        torch.testing.assert_close(after[n], before[n], rtol=1e-6, atol=1e-7)
    # 1 call + 1 body run per forward; a checkpointed block runs its body once more in backward.
    assert calls == [21 if i in expected else 11 for i in range(4)]


def test_checkpointing_frees_activations():
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=64, block_size=64)
    x = torch.randint(0, 256, (4, 64))

    def saved_bytes() -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        return total

    plain = saved_bytes()
    trunk = find_trunk(model)
    assert trunk is not None
    apply_activation_checkpointing(trunk.blocks, "full")
    checkpointed = saved_bytes()
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


def test_trunk_detection():
    gpt, llama = GPT(n_layer=3), Llama(n_layers=3)
    assert find_trunk(gpt).path == "transformer.h"
    assert find_trunk(gpt).names == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert find_trunk(llama).path == "layers"
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert find_trunk(seq).names == ("0", "1")  # the final norm is not a block
    assert find_trunk(torch.nn.Linear(3, 3)) is None
    # Large vocabulary, small width: the two embeddings outweigh the blocks but are not the trunk.
    wide_vocab = GPT(n_layer=2, n_embd=64, vocab_size=32000, block_size=512)
    emb = sum(p.numel() for p in wide_vocab.transformer.wte.parameters())
    emb += sum(p.numel() for p in wide_vocab.transformer.wpe.parameters())
    assert emb > sum(p.numel() for p in wide_vocab.transformer.h.parameters())
    assert find_trunk(wide_vocab).path == "transformer.h"
