"""Staging accelerator tensors for an asynchronous save: pinned host buffers, a side stream, and two fences.

A plain ``cpu_buffer.copy_(cuda_tensor)`` into pageable memory is synchronous: the save would block for the whole
device-to-host copy of this rank's model and optimizer state (GBs at ~10-25 GB/s), and the asynchronous save's
point would be lost on a GPU. Here every copy is issued ``non_blocking`` into a page-locked buffer (reused by the
next save, as the CPU buffers are) on a stream of the saver's own, which first waits for the work already queued on
the training stream, so it copies the values of the save's moment. Then:

- tensors that the next forward may change (buffers such as BatchNorm statistics) are copied first, and the
  training stream waits on an event recorded after them: a device-side fence, the host does not wait;
- parameters and optimizer state (which only an optimizer step changes) are copied after them, and the host waits
  for the event recorded after everything in the saver's worker thread (`DeviceCopies.wait`), before it writes and
  before the optimizer step's pre-hook (`AsyncSaver.wait_for_staging`) lets that step run. The copies overlap the
  next forward and backward on the GPU's copy engine, the pattern torchtitan uses for its asynchronous checkpoints.

``record_stream`` tells the caching allocator that the side stream reads each source, so a tensor freed on the
training stream meanwhile (a buffer replaced rather than updated) is not handed out again before its copy is done.
"""

from __future__ import annotations

from typing import Optional

import torch


class DeviceCopies:
    """The copies of one save's accelerator tensors, issued together by `issue`, waited for by `wait`."""

    def __init__(self) -> None:
        self._now: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pinned buffer, source): fenced on the device
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []  # fenced on the host before the optimizer step
        self._done: Optional[torch.cuda.Event] = None

    def __bool__(self) -> bool:
        return bool(self._now or self._later or self._done is not None)

    def add(self, buffer: torch.Tensor, source: torch.Tensor, deferred: bool) -> None:
        """Queue ``buffer.copy_(source)``; ``deferred`` if only an optimizer step changes ``source``."""
        (self._later if deferred else self._now).append((buffer, source))

    def issue(self, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        """Issue every queued copy on the saver's stream of each device (created once, kept in ``streams``)."""
        devices = {source.device for _, source in self._now + self._later}
        if len(devices) > 1:  # one rank, one device; the fences below assume it
            found = sorted(map(str, devices))
            raise RuntimeError(f"an asynchronous save found tensors on {found}; one device per rank expected")
        if not devices:
            return
        device = devices.pop()
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)
        training = torch.cuda.current_stream(device)
        stream.wait_stream(training)  # copy what the queued work leaves, not what was there when it was queued
        with torch.cuda.stream(stream):
            for buffer, source in self._now:
                buffer.copy_(source, non_blocking=True)
                source.record_stream(stream)
            forward_may_go = torch.cuda.Event()
            forward_may_go.record(stream)
            for buffer, source in self._later:
                buffer.copy_(source, non_blocking=True)
                source.record_stream(stream)
            self._done = torch.cuda.Event()
            self._done.record(stream)
        training.wait_event(forward_may_go)
        self._now, self._later = [], []

    def wait(self) -> None:
        """Block the calling thread until every issued copy has landed in its buffer."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None


def pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialized host buffer for ``tensor``'s values: page-locked where a CUDA device exists to copy from."""
    return torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type == "cuda")
