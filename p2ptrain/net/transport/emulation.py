"""Link emulation: each directed link a→b is a FIFO in the sender (DESIGN.md, "Link emulation").

A message of n bytes sent at time t on a link with latency α and bandwidth β

    starts    = max(t, link_free_at)     # waits until the link is free (FIFO)
    frees     = start + n / β            # occupies the link n/β: bandwidth serialises
    arrives   = frees + α                # latency overlaps with the next message's serialisation

and byte e of it arrives at ``start + e/β + α``. This module is pure bookkeeping with an injected clock
(unit-testable without sleeping); the transport sleeps until the times it returns before the real bytes go
out, so every byte the runtime and the link prober send is shaped and agents *measure* the emulated network.
Destinations without a profile are not shaped; an emulator without profiles changes nothing.

Replaying a cluster of the paper with a small model on one machine takes two factors (DESIGN.md)::

    α' = α × time_scale          β' = β × size_factor / time_scale

``size_factor`` is this run's bytes per message over the paper's, so a transfer takes as long relative to
latency as the paper's did; ``time_scale`` turns the paper's seconds into a fraction of a second. Use
``scaled_link`` for one link and ``set_links_from_matrices`` for a whole cluster file.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BITS_PER_BYTE = 8


@dataclass(frozen=True)
class LinkProfile:
    """One directed link: one-way latency and bandwidth, as the emulator applies them."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self):
        if not self.latency_s >= 0.0:  # also refuses NaN
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0.0 or self.bandwidth_bytes_per_s == float("inf"):
            raise ValueError(f"link bandwidth must be a positive finite number of bytes/s, got {self.bandwidth_bytes_per_s}")

    def transfer_s(self, size_bytes: int) -> float:
        """Time from the first byte entering a free link to the last byte arriving."""
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Reservation:
    """The slot one message got on its link: when it starts, frees the link, and arrives (clock seconds)."""

    start_s: float
    free_s: float
    arrive_s: float
    link: LinkProfile

    def release_s(self, end_offset_bytes: int) -> float:
        """When the bytes up to ``end_offset_bytes`` of the message have arrived at the receiver."""
        return self.start_s + end_offset_bytes / self.link.bandwidth_bytes_per_s + self.link.latency_s


@dataclass(frozen=True)
class EmulationConfig:
    """How a cluster's α (ms) and β (Gbit/s) map onto emulated links; see the module docstring."""

    time_scale: float = 1.0
    size_factor: float = 1.0

    def __post_init__(self):
        for name in ("time_scale", "size_factor"):
            value = getattr(self, name)
            if not 0.0 < value < float("inf"):
                raise ValueError(f"emulation {name} must be a positive number, got {value}")


def scaled_link(latency_ms: float, bandwidth_gbps: float, config: EmulationConfig | None = None) -> LinkProfile:
    """The emulated link for a cluster link of ``latency_ms`` α and ``bandwidth_gbps`` β (1 Gbit = 1e9 bits).

    α' = α × time_scale, β' = β × size_factor / time_scale (both factors 1 without a config).
    """
    config = config or EmulationConfig()
    return LinkProfile(
        latency_s=latency_ms / 1e3 * config.time_scale,
        bandwidth_bytes_per_s=bandwidth_gbps * 1e9 / BITS_PER_BYTE * config.size_factor / config.time_scale,
    )


class LinkEmulator:
    """Per-destination FIFO bookkeeping for the links out of one peer. Thread-safe; no I/O, no sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._links: dict[str, LinkProfile] = {}
        self._free_at_s: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._links)

    def set_link(self, peer: str, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        """Shape messages to ``peer`` (base58 peer ID) from now on; may be called at any time."""
        profile = LinkProfile(latency_s, bandwidth_bytes_per_s)
        with self._lock:
            self._links[str(peer)] = profile

    def clear_link(self, peer: str) -> None:
        """Stop shaping messages to ``peer``; messages already reserved keep their slots."""
        with self._lock:
            self._links.pop(str(peer), None)
            self._free_at_s.pop(str(peer), None)

    def link(self, peer: str) -> LinkProfile | None:
        with self._lock:
            return self._links.get(str(peer))

    def reserve(self, peer: str, size_bytes: int) -> Reservation | None:
        """Book the link to ``peer`` for a message of ``size_bytes``; None when the link is not shaped."""
        if size_bytes < 0:
            raise ValueError(f"message size must be >= 0 bytes, got {size_bytes}")
        with self._lock:
            profile = self._links.get(str(peer))
            if profile is None:
                return None
            start_s = max(self.clock(), self._free_at_s.get(str(peer), float("-inf")))
            free_s = start_s + size_bytes / profile.bandwidth_bytes_per_s
            self._free_at_s[str(peer)] = free_s
        return Reservation(start_s=start_s, free_s=free_s, arrive_s=free_s + profile.latency_s, link=profile)

    def set_links_from_matrices(
        self,
        peers: Sequence[str],
        me: int,
        latency_ms: Sequence[Sequence[float]],
        bandwidth_gbps: Sequence[Sequence[float]],
        config: EmulationConfig | None = None,
    ) -> None:
        """Shape the links out of device ``me`` from a cluster file's matrices (``peers[i]`` is device i).

        Only row ``me`` is used: the sender models its own outgoing links; the diagonal is ignored.
        """
        if not 0 <= me < len(peers):
            raise ValueError(f"device index {me} is not in 0..{len(peers) - 1}")
        if len(latency_ms[me]) != len(peers) or len(bandwidth_gbps[me]) != len(peers):
            raise ValueError(f"link matrices have {len(latency_ms[me])} columns, expected {len(peers)} peers")
        for j, peer in enumerate(peers):
            if j != me:
                profile = scaled_link(latency_ms[me][j], bandwidth_gbps[me][j], config)
                self.set_link(peer, profile.latency_s, profile.bandwidth_bytes_per_s)
