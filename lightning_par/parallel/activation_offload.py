"""Activation offload that overlaps: what a block saves for its backward goes to host memory during the forward and
comes back ahead of its backward, on a side stream, while the default stream computes.

For each offloaded block, its forward runs under saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`):

- pack: a tensor the block saves is copied into pinned host memory on the side stream, after the default stream's
  work so far (the side stream waits for it); the device memory goes back to the allocator once that copy has run
  (``record_stream``), not when the forward's compute reaches it, so the copy overlaps the forward. Kept on the
  device: tensors that share a parameter's storage (a matmul's weight: copying it out and back frees nothing; under
  ZeRO-3 the gathered weights FSDP2 registers on the block), tensors under 1 KiB (the launch costs more than the
  bytes; torchtune's threshold) and tensor subclasses (DTensors, fp8 tensors: their layout is not plain storage).
- unpack: the first tensor a block's backward asks for starts bringing back every tensor of the block that runs
  its backward next (the previous block of the same forward: blocks differentiate in reverse order), on the side
  stream; the default stream waits only for the tensor it asks for. So block i-1's activations cross back while
  block i's backward computes (the prefetch of torchtune's ``OffloadActivations`` and Megatron-LM's CPU offload).
- on a device without CUDA streams (CPU) the same bookkeeping runs with plain copies: the values, the gradients,
  the blocks offloaded and what is prefetched are what they are on a GPU; nothing is gained (host and device are
  one memory), and `ActivationOffload.host_bytes` says how much of the live memory is "host".

Which blocks: every block, or the first ``offload_blocks`` of the trunk (Megatron-LM's ``cpu_offloading_num_layers``:
the first blocks' activations live longest, from their forward to the end of the backward). Values and gradients
are those of no offload (the copies are exact). docs/checkpointing.md, "Activation checkpointing".
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from lightning_par import _compat
from lightning_par.utils import dtensors

MIN_BYTES = 1024


@dataclasses.dataclass(eq=False)
class _Call:
    """One forward call of one block: the generation says which call of the previous block is the same forward."""

    block: int
    generation: int
    # Weak: a store holds its call, and autograd holds the stores; a strong cycle would keep the host memory of a
    # freed graph until the garbage collector runs.
    stores: list[weakref.ReferenceType[_Stored]] = dataclasses.field(default_factory=list)
    started: bool = False  # its backward has asked for a tensor


@dataclasses.dataclass(eq=False)
class _Stored:
    """A saved tensor in host memory, and (once asked for or prefetched) its copy back on the device."""

    call: _Call
    host: Optional[torch.Tensor]
    device: torch.device
    out: Optional[Any] = None  # CUDA: the event after the copy out
    back: Optional[torch.Tensor] = None
    back_ready: Optional[Any] = None  # CUDA: the event after the copy back
    last: Optional[torch.Tensor] = None  # what the first unpack returned (a store several ops saved)


class ActivationOffload:
    """The offloaded blocks of one model: one side stream, the calls not yet differentiated, byte counters."""

    def __init__(self) -> None:
        self.stream: Optional[torch.cuda.Stream] = None
        self._calls: dict[int, list[weakref.ReferenceType[_Call]]] = {}
        self._generation: dict[int, int] = {}
        self._held: weakref.WeakSet[_Stored] = weakref.WeakSet()
        self.moved_bytes = 0  # bytes copied to host memory, in all
        self.prefetched = 0  # tensors brought back ahead of their unpack

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory now (saved tensors of forwards whose backward has not asked for them)."""
        return sum(s.host.untyped_storage().nbytes() for s in list(self._held) if s.host is not None)

    def wrap(self, index: int, block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` of the trunk's block ``index``, its saved tensors offloaded."""
        return functools.partial(self._run, index, block, forward)

    def _run(self, index: int, block: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # (the storages a parameter's values sit in: a DTensor's shard, what a wrapper subclass holds: fp8's weights)
        keep = {part.untyped_storage().data_ptr() for p in block.parameters() for part in dtensors.storages(p)} - {0}
        made: list[_Call] = []
        # A tensor several ops save (the input of q, k and v projections) is copied once. Keyed by its storage and
        # layout, and only while that storage lives: a later tensor at a freed tensor's address is another tensor.
        copied: dict[tuple[Any, ...], tuple[Any, _Stored]] = {}

        def pack(t: torch.Tensor) -> Any:
            if type(t) is not torch.Tensor or t.numel() * t.element_size() < MIN_BYTES or \
                    t.untyped_storage().data_ptr() in keep:  # fmt: skip
                return t
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in copied and not copied[key][0].expired():
                return copied[key][1]
            if not made:  # the call's record, at its first saved tensor (a forward without grad makes none)
                made.append(self._new_call(index))
            stored = self._store(made[0], t)
            copied[key] = (_compat.StorageWeakRef(t.untyped_storage()), stored)
            return stored

        with saved_tensors_hooks(pack, self._unpack):
            return forward(*args, **kwargs)

    def _new_call(self, index: int) -> _Call:
        generation = self._generation.get(index, 0)
        self._generation[index] = generation + 1
        call = _Call(index, generation)
        live = [r for r in self._calls.get(index, []) if r() is not None]
        self._calls[index] = [*live, weakref.ref(call)]
        return call

    def _store(self, call: _Call, t: torch.Tensor) -> _Stored:
        if t.is_cuda:
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                out = torch.cuda.Event()
                out.record(self.stream)
            t.record_stream(self.stream)  # its memory is reused only after the copy out has run
        else:
            host, out = t.clone(), None
        stored = _Stored(call, host, t.device, out)
        call.stores.append(weakref.ref(stored))
        self._held.add(stored)
        self.moved_bytes += host.untyped_storage().nbytes()
        return stored

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Stored):
            return packed
        call = packed.call
        if not call.started:
            call.started = True
            self._prefetch(call.block - 1, call.generation)
        if packed.back is None and packed.host is None:  # a tensor saved twice, asked for again: autograd has it
            assert packed.last is not None
            return packed.last
        return self._take(packed)

    def _prefetch(self, block: int, generation: int) -> None:
        for ref in self._calls.get(block, []):
            call = ref()
            if call is not None and call.generation == generation:
                for ref_stored in call.stores:
                    stored = ref_stored()
                    if stored is not None and stored.back is None and stored.host is not None:
                        self._bring_back(stored)
                        self.prefetched += 1

    def _bring_back(self, stored: _Stored) -> None:
        assert stored.host is not None
        if self.stream is not None and stored.device.type == "cuda":
            with torch.cuda.stream(self.stream):
                if stored.out is not None:
                    self.stream.wait_event(stored.out)
                stored.back = stored.host.to(stored.device, non_blocking=True)
                stored.back_ready = torch.cuda.Event()
                stored.back_ready.record(self.stream)
        else:
            stored.back = stored.host
        stored.host = None  # the pinned allocator keeps the block until the copy back has run

    def _take(self, stored: _Stored) -> torch.Tensor:
        if stored.back is None:
            self._bring_back(stored)
        back = stored.back
        assert back is not None
        if stored.back_ready is not None:
            current = torch.cuda.current_stream(stored.device)
            current.wait_event(stored.back_ready)
            back.record_stream(current)  # allocated on the side stream, used on this one
        # Kept while autograd keeps the store: another op that saved the same tensor asks for it later.
        stored.back, stored.back_ready, stored.last = None, None, back
        return back


def offload_of(block: nn.Module) -> Optional[ActivationOffload]:
    """The `ActivationOffload` whose hooks run ``block``'s forward, if any."""
    forward = block.forward
    bound = getattr(forward, "func", None)
    owner = getattr(bound, "__self__", None)
    return owner if isinstance(owner, ActivationOffload) else None
