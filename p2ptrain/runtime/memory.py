"""Activation memory of a stage, measured: the bytes of tensors autograd saved for backward, held at once.

    meter = ActivationMeter(module.parameters())
    with meter.saving():
        out = module(x)                 # every tensor saved for backward is counted while it lives
    out.backward(grad)                  # ... and released when autograd frees it
    print(meter.peak_bytes)

Counted per storage (a storage saved by several ops, or by several views, counts once), parameters left
out (they are the stage's weights, not activations). A saved tensor is released when autograd drops it:
after the backward that used it, or when its graph is garbage.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch


class _Held:
    """One saved tensor as autograd keeps it; its end releases its storage's count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Live and peak bytes of saved activations (see the module docstring)."""

    def __init__(self, parameters: Iterable[torch.Tensor]):
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._lock = threading.Lock()  # autograd may free saved tensors on its own threads
        self._counts: dict[int, tuple[int, int]] = {}  # storage pointer -> (references, bytes)
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset(self, parameters: Iterable[torch.Tensor]) -> None:
        """Start a new peak; ``parameters`` are the ones to leave out now (a state hand-over may have
        replaced their storage)."""
        with self._lock:
            self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
            self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Count the tensors autograd saves inside this block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages or ptr == 0:
            return tensor
        held = _Held(tensor)
        with self._lock:
            refs, nbytes = self._counts.get(ptr, (0, storage.nbytes()))
            if refs == 0:
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._counts[ptr] = (refs + 1, nbytes)
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, ptr: int) -> None:
        with self._lock:
            refs, nbytes = self._counts[ptr]
            if refs == 1:
                del self._counts[ptr]
                self.live_bytes -= nbytes
            else:
                self._counts[ptr] = (refs - 1, nbytes)
