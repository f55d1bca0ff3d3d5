"""Link emulation: each directed link a→b is a FIFO in the sender, each peer's access link a FIFO of its own
(docs/design.md, "Link emulation").

A peer a may have an uplink U_a and a downlink D_a (bytes/s; absent: unlimited), as a home router's queues
would shape them, besides each directed pair's latency α and path bandwidth β. A message of n bytes that a
sends to b, ready at time t:

    sender (LinkEmulator.reserve, in a)          start  s  = max(t, pair_free[a→b], up_free[a])
                                                  pair_free[a→b] = s + n / min(β, U_a)
                                                  up_free[a]     = s + n / U_a
    its byte e reaches b at s + e / min(β, U_a) + α; the last at e_end = s + n / min(β, U_a) + α
    receiver (Downlink.reserve, in b)             d  = max(s + α, down_free[b])
                                                  down_free[b]   = d + n / D_b
    delivered at                                  f  = max(d + n / D_b, e_end)

Bandwidth serialises (one queue per resource, FIFO), latency overlaps with the next message's serialisation.
Without U and D this is the pair's FIFO alone: start = max(t, link_free_at), frees = start + n/β, arrives =
frees + α. The receiver does not know s or α: it books the downlink when a message's first bytes come in
(they stand for s + α) and holds the message until f, the later of its downlink slot's end and its last
bytes' arrival. It does so for every sender, shaped or not.

This module is pure bookkeeping with an injected clock (unit-testable without sleeping); the transport
sleeps until the times it returns before the real bytes go out, and holds received messages until their
downlink lets them through, so every byte the runtime and the link prober send is shaped and agents
*measure* the emulated network. Destinations with neither a pair profile nor an uplink are not shaped; an
emulator without profiles and access links changes nothing.

Replaying a cluster of the paper with a small model on one machine takes two factors (docs/design.md)::

    α' = α × time_scale          β' = β × size_factor / time_scale          (U' and D' as β')

``size_factor`` is this run's bytes per message over the paper's, so a transfer takes as long relative to
latency as the paper's did; ``time_scale`` turns the paper's seconds into a fraction of a second. Use
``scaled_link`` for one link, ``scaled_bandwidth`` for an access link and ``set_links_from_matrices`` for a
whole cluster file.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BITS_PER_BYTE = 8


def _check_rate(name: str, bytes_per_s: float) -> None:
    if not bytes_per_s > 0.0 or bytes_per_s == float("inf"):  # also refuses NaN
        raise ValueError(f"{name} must be a positive finite number of bytes/s, got {bytes_per_s}")


@dataclass(frozen=True)
class LinkProfile:
    """One directed link: one-way latency and bandwidth, as the emulator applies them."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self):
        if not self.latency_s >= 0.0:  # also refuses NaN
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")
        _check_rate("link bandwidth", self.bandwidth_bytes_per_s)

    def transfer_s(self, size_bytes: int) -> float:
        """Time from the first byte entering a free link to the last byte arriving."""
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Reservation:
    """The slot one message got: when it starts, frees its pair link, and arrives (clock seconds); ``link`` is
    the link as the message crosses it: the pair's α, and the rate its bytes flow at, min(β, U)."""

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


def scaled_bandwidth(bandwidth_gbps: float, config: EmulationConfig | None = None) -> float:
    """The emulated bytes/s of a cluster's ``bandwidth_gbps`` (1 Gbit = 1e9 bits): β × size_factor /
    time_scale. A pair's β and a peer's access capacities U and D scale alike."""
    config = config or EmulationConfig()
    return bandwidth_gbps * 1e9 / BITS_PER_BYTE * config.size_factor / config.time_scale


def scaled_link(latency_ms: float, bandwidth_gbps: float, config: EmulationConfig | None = None) -> LinkProfile:
    """The emulated link for a cluster link of ``latency_ms`` α and ``bandwidth_gbps`` β (1 Gbit = 1e9 bits).

    α' = α × time_scale, β' = β × size_factor / time_scale (both factors 1 without a config).
    """
    config = config or EmulationConfig()
    return LinkProfile(latency_s=latency_ms / 1e3 * config.time_scale,
                       bandwidth_bytes_per_s=scaled_bandwidth(bandwidth_gbps, config))


class Downlink:
    """A peer's downlink: one FIFO of D bytes/s that every incoming message crosses, whoever sent it.
    Thread-safe; no I/O, no sleeping. Unlimited (no bookkeeping) until ``set``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._bandwidth_bytes_per_s: float | None = None
        self._free_at_s = float("-inf")
        self._lock = threading.Lock()

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        return self._bandwidth_bytes_per_s

    def set(self, bandwidth_bytes_per_s: float | None) -> None:
        """Shape incoming messages at ``bandwidth_bytes_per_s`` from now on (the queue stays); None:
        unlimited."""
        if bandwidth_bytes_per_s is not None:
            _check_rate("downlink bandwidth", bandwidth_bytes_per_s)
        with self._lock:
            self._bandwidth_bytes_per_s = bandwidth_bytes_per_s
            if bandwidth_bytes_per_s is None:
                self._free_at_s = float("-inf")

    def reserve(self, size_bytes: int) -> float | None:
        """Book a message of ``size_bytes`` whose first bytes came in now (the sender's s + α): when the
        downlink has let its last byte through, d + n/D; None when unlimited. It is delivered at the later of
        this and its last bytes' arrival."""
        if size_bytes < 0:
            raise ValueError(f"message size must be >= 0 bytes, got {size_bytes}")
        with self._lock:
            if self._bandwidth_bytes_per_s is None:
                return None
            start_s = max(self.clock(), self._free_at_s)
            self._free_at_s = start_s + size_bytes / self._bandwidth_bytes_per_s
            return self._free_at_s


class LinkEmulator:
    """Per-destination FIFO bookkeeping for the links out of one peer, its uplink shared by all of them, and
    its downlink (``downlink``, which the transport's receiving side books). Thread-safe; no I/O, no
    sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.downlink = Downlink(clock)
        self._links: dict[str, LinkProfile] = {}
        self._free_at_s: dict[str, float] = {}
        self._uplink_bytes_per_s: float | None = None
        self._up_free_at_s = float("-inf")
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        access = (self._uplink_bytes_per_s, self.downlink.bandwidth_bytes_per_s)
        return bool(self._links) or access != (None, None)

    @property
    def uplink_bytes_per_s(self) -> float | None:
        return self._uplink_bytes_per_s

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

    def access(self) -> tuple[float | None, float | None]:
        """This peer's uplink and downlink, bytes/s (None: unlimited)."""
        with self._lock:
            return self._uplink_bytes_per_s, self.downlink.bandwidth_bytes_per_s

    def set_access(
        self, uplink_bytes_per_s: float | None = None, downlink_bytes_per_s: float | None = None
    ) -> None:
        """This peer's access link from now on: every message out shares the uplink, every message in the
        downlink (None: unlimited; ``set_access()`` clears both). Queues stay while a capacity changes."""
        if uplink_bytes_per_s is not None:
            _check_rate("uplink bandwidth", uplink_bytes_per_s)
        self.downlink.set(downlink_bytes_per_s)
        with self._lock:
            self._uplink_bytes_per_s = uplink_bytes_per_s
            if uplink_bytes_per_s is None:
                self._up_free_at_s = float("-inf")

    def reserve(self, peer: str, size_bytes: int) -> Reservation | None:
        """Book the link to ``peer`` and the uplink for a message of ``size_bytes``; None when neither shapes
        it (a destination without a profile crosses only the uplink: α = 0, β unlimited)."""
        if size_bytes < 0:
            raise ValueError(f"message size must be >= 0 bytes, got {size_bytes}")
        with self._lock:
            pair, uplink = self._links.get(str(peer)), self._uplink_bytes_per_s
            if pair is None and uplink is None:
                return None
            profile = pair or LinkProfile(0.0, uplink)
            if uplink is not None and uplink < profile.bandwidth_bytes_per_s:
                profile = LinkProfile(profile.latency_s, uplink)
            start_s = max(self.clock(), self._free_at_s.get(str(peer), float("-inf")), self._up_free_at_s)
            free_s = start_s + size_bytes / profile.bandwidth_bytes_per_s
            if pair is not None:  # without one, the uplink is the only queue the message waits in
                self._free_at_s[str(peer)] = free_s
            if uplink is not None:
                self._up_free_at_s = start_s + size_bytes / uplink
        return Reservation(start_s=start_s, free_s=free_s, arrive_s=free_s + profile.latency_s, link=profile)

    def set_links_from_matrices(
        self,
        peers: Sequence[str],
        me: int,
        latency_ms: Sequence[Sequence[float]],
        bandwidth_gbps: Sequence[Sequence[float]],
        config: EmulationConfig | None = None,
        uplink_gbps: Sequence[float | None] | None = None,
        downlink_gbps: Sequence[float | None] | None = None,
    ) -> None:
        """Shape the links out of device ``me`` from a cluster file's matrices (``peers[i]`` is device i), and
        its access link from the per-device ``uplink_gbps`` and ``downlink_gbps`` (None, an entry None or
        infinite: unlimited).

        Only row ``me`` and entry ``me`` are used: the sender models its own outgoing links, the receiver its
        own downlink; the diagonal is ignored.
        """
        if not 0 <= me < len(peers):
            raise ValueError(f"device index {me} is not in 0..{len(peers) - 1}")
        if len(latency_ms[me]) != len(peers) or len(bandwidth_gbps[me]) != len(peers):
            raise ValueError(f"link matrices have {len(latency_ms[me])} columns, expected {len(peers)} peers")
        access = []
        for name, capacities in (("uplink_gbps", uplink_gbps), ("downlink_gbps", downlink_gbps)):
            if capacities is not None and len(capacities) != len(peers):
                raise ValueError(f"{name} has {len(capacities)} entries, expected {len(peers)} peers")
            gbps = None if capacities is None else capacities[me]
            access.append(None if gbps is None or math.isinf(gbps) else scaled_bandwidth(gbps, config))
        for j, peer in enumerate(peers):
            if j != me:
                profile = scaled_link(latency_ms[me][j], bandwidth_gbps[me][j], config)
                self.set_link(peer, profile.latency_s, profile.bandwidth_bytes_per_s)
        self.set_access(*access)
