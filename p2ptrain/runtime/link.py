"""The executor's view of the transport: messages of one (run, epoch, step), addressed by peer."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import Tag


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
