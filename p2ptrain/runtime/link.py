"""The executor's view of the transport: messages of one (run, epoch, step), addressed by peer (``StepLink``;
``TransportStepLink`` over a ``Transport``), and by rank inside a stage's replica group (``GroupOverLink``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import Tag


class StepLink(Protocol):
    """Messages of one step to and from named peers. ``send`` may read ``tensor`` until its future is done: the
    executor and the all-reduce hand over tensors they never change (encoded messages, detached outputs and
    input gradients, freshly flattened buckets) and wait for every send before a step ends."""

    def send(self, peer: str, kind: str, micro_batch: int, part: int, tensor: torch.Tensor) -> Future: ...

    def recv(
        self, peer: str, kind: str, micro_batch: int, part: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...

    def for_step(self, step: int) -> StepLink:
        """The same peers' messages of another step (DiLoCo's overlapped all-reduce is tagged with the step
        that applies it)."""
        ...


class GroupOverLink:
    """Adapts a StepLink to the all-reduce's rank addressing inside stage ``stage``'s group; ``bucket`` goes in
    the micro-batch field of the tags."""

    def __init__(self, link: StepLink, group: tuple[str, ...], bucket: int = 0):
        self.link, self.group, self.bucket = link, group, bucket

    def send(self, to_rank: int, kind: str, part: int, tensor: torch.Tensor) -> Future:
        return self.link.send(self.group[to_rank], kind, self.bucket, part, tensor)

    def recv(self, from_rank: int, kind: str, part: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.link.recv(self.group[from_rank], kind, self.bucket, part, shape, dtype)


class TransportStepLink:
    """A ``StepLink`` over a ``Transport``: fills in the run, epoch and step of every tag."""

    def __init__(self, transport: Transport, run: str, epoch: int, step: int, timeout_s: float):
        self.transport = transport
        self.run, self.epoch, self.step = run, epoch, step
        self.timeout_s = timeout_s

    def _tag(self, kind: str, micro_batch: int, part: int) -> Tag:
        return Tag(self.run, self.epoch, self.step, kind, micro_batch, part)

    def send(self, peer: str, kind: str, micro_batch: int, part: int, tensor: torch.Tensor) -> Future:
        # Handed over, not copied (``StepLink.send``): the copy was most of what a message cost this thread.
        return self.transport.send_async(peer, self._tag(kind, micro_batch, part), tensor, self.timeout_s, copy=False)

    def recv(
        self, peer: str, kind: str, micro_batch: int, part: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return self.transport.recv(self._tag(kind, micro_batch, part), peer, shape, dtype, self.timeout_s)

    def for_step(self, step: int) -> TransportStepLink:
        return TransportStepLink(self.transport, self.run, self.epoch, step, self.timeout_s)
