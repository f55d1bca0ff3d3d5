"""Measuring this peer's access link: the uplink and the downlink that all of its flows share (a home's line).

A pair's probe (``probe.py``) times one path alone: the slowest of our uplink, the path and the peer's
downlink, so one probe cannot tell our line from the path. The line is what flows share, so it shows when
several run at once. For each direction, over the k fastest peers by their pair probes
(``AccessConfig.min_peers`` ≤ k ≤ ``max_peers``), each on a probe stream of its own:

1. ``pings`` empty probes per peer: each path's floor, the smallest delay of an empty probe.
2. Singles: each peer alone, a transfer of n_i = b_i × T bytes (b_i: the pair's rate as far as known, T the
   flow time), resized once if it took under half of T, the fastest of ``tries``: b_i = n_i / (delay − floor).
   Uplink: we send n_i bytes (a push, as the pair probe; the delay is the one-way delay when the peer reports
   arrivals); downlink: the peer sends them (a pull: a probe asking for n_i bytes back; the round trip).
3. The aggregate: all k at once, each flow n_i = b_i × T; A = Σ n_i / max_i (delay_i − floor_i), the largest
   of ``tries`` (the least disturbed).
4. ``estimate_access`` (pure): without a shared bottleneck every flow ends after about T and A ≈ Σ b_i:
   the line carries at least that, but how much more is not measured, so the answer is *unknown*. When A is
   at most ``shared_share`` × Σ b_i, the flows queued in something they share: not the peers' lines (each
   carries one flow, and its single b_i already had it) but ours; the line carried A with the flows keeping
   it busy, and each b_i alone, so its capacity is max(A, max b_i). Fewer than ``min_peers`` peers, or an A
   below ``disturbed_share`` × max b_i (slower than one path alone: the measurement was disturbed), is
   unknown too. A is a lower bound: a FIFO line that a flow left early idles for the rest.

T = max(``flow_s``, ``rtt_multiple`` × the slowest ping's round trip), at most the pair probe's
``max_transfer_s``; each flow at most ``max_transfer_bytes`` (pulls: the transport's
``max_probe_reply_bytes``), all of them together at most ``max_total_bytes``. So the line is kept full for
about k × T once per try (a 10 Mbit/s uplink, 4 peers: 2 s at the defaults), the whole measurement (both
directions) under ``deadline_s``, every round trip under the transport's call deadline, and ``stop`` (the
prober's pause) asked between steps ends it without a result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from p2ptrain.errors import PeerTimeoutError, ProtocolError

if TYPE_CHECKING:
    from p2ptrain.net.transport.endpoint import Transport
    from p2ptrain.net.transport.probe_session import ProbeSession, RoundTrip

logger = logging.getLogger(__name__)

BITS_PER_BYTE = 8
MIN_SERIAL_S = 1e-6  # a transfer faster than this is below what we can time
T = TypeVar("T")


class Direction(str, Enum):
    UP = "uplink"  # we send to k peers at once
    DOWN = "downlink"  # k peers send to us at once (pulls)


@dataclass(frozen=True)
class AccessConfig:
    """How an agent measures its access link (module docstring); sizes in bytes, times in seconds."""

    max_peers: int = 4
    min_peers: int = 2  # fewer peers: unknown (one flow cannot tell our line from its path)
    pings: int = 4
    tries: int = 2  # singles and aggregates each measured this many times; the fastest counts
    flow_s: float = 0.5  # T: how long each flow takes alone
    rtt_multiple: float = 3.0  # ... and at least this many round trips of the slowest path
    max_transfer_s: float = 2.0
    max_transfer_bytes: int = 32 << 20
    max_total_bytes: int = 64 << 20  # all flows of one aggregate together
    shared_share: float = 0.7  # A at most this share of Σ b_i: a shared bottleneck (ours)
    disturbed_share: float = 0.5  # A under this share of the fastest single: disturbed, unknown
    deadline_s: float = 60.0  # both directions
    refresh_s: float = 600.0  # measured again after this long (the pair probes' refresh_s is shorter)

    def __post_init__(self):
        if not 2 <= self.min_peers <= self.max_peers:
            raise ValueError(f"need 2 <= min_peers <= max_peers, got {self.min_peers} and {self.max_peers}")
        if self.pings < 1 or self.tries < 1:
            raise ValueError("pings and tries must be at least 1")
        if not 0 < self.flow_s <= self.max_transfer_s or self.rtt_multiple < 0:
            raise ValueError("need 0 < flow_s <= max_transfer_s and rtt_multiple >= 0")
        if not 0 < self.max_transfer_bytes <= self.max_total_bytes:
            raise ValueError("need 0 < max_transfer_bytes <= max_total_bytes")
        if not 0 < self.disturbed_share < 1 or not 0 < self.shared_share < 1:
            raise ValueError("shared_share and disturbed_share must be shares in (0, 1)")
        if not self.deadline_s > 0 or self.refresh_s < 0:
            raise ValueError("deadline_s must be positive and refresh_s >= 0")


@dataclass(frozen=True)
class AccessEstimate:
    """One direction of the line: its capacity (bytes/s), or None (unknown) with the reason."""

    capacity_bytes_per_s: float | None
    reason: str

    @property
    def gbps(self) -> float | None:
        return None if self.capacity_bytes_per_s is None else self.capacity_bytes_per_s * BITS_PER_BYTE / 1e9


def estimate_access(
    singles_bytes_per_s: Sequence[float], aggregates_bytes_per_s: Sequence[float], config: AccessConfig
) -> AccessEstimate:
    """The line's capacity from each path's rate alone (b_i) and the aggregate rates of all of them at once
    (the tries'), or unknown; the rule is the module docstring's step 4."""
    if len(singles_bytes_per_s) < config.min_peers:
        return AccessEstimate(None, f"{len(singles_bytes_per_s)} peers measured, fewer than {config.min_peers}")
    if not aggregates_bytes_per_s:
        return AccessEstimate(None, "no aggregate measured")
    total, fastest = sum(singles_bytes_per_s), max(singles_bytes_per_s)
    aggregate = max(aggregates_bytes_per_s)
    if aggregate > config.shared_share * total:
        return AccessEstimate(None, f"no shared bottleneck: {len(singles_bytes_per_s)} flows at once carried "
                                    f"{aggregate / total:.0%} of their rates alone")  # fmt: skip
    if aggregate < config.disturbed_share * fastest:
        return AccessEstimate(None, f"disturbed: the flows at once carried {aggregate / fastest:.0%} of the "
                                    "fastest path alone")  # fmt: skip
    return AccessEstimate(max(aggregate, fastest), f"{len(singles_bytes_per_s)} flows at once carried "
                                                   f"{aggregate / total:.0%} of their rates alone")  # fmt: skip


class _Stopped(Exception):
    pass


def measure_access(
    transport: Transport, paths_bytes_per_s: Mapping[str, float], config: AccessConfig | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[Direction, AccessEstimate] | None:
    """Both directions of our line (blocking), from the peers ``paths_bytes_per_s`` names with their pair
    probes' rates; None once ``stop()`` says to stop. A direction that a peer fails (it left, timed out, refused a
    pull), or that ran past ``config.deadline_s``, is unknown with the reason; a peer that cannot be reached
    for a probe stream raises (PeerTimeoutError naming it)."""
    config = config or AccessConfig()
    return transport.run_coroutine(ameasure_access(transport, paths_bytes_per_s, config, stop), config.deadline_s + 5.0)


async def ameasure_access(
    transport: Transport, paths_bytes_per_s: Mapping[str, float], config: AccessConfig,
    stop: Callable[[], bool] | None = None,
) -> dict[Direction, AccessEstimate] | None:
    """``measure_access`` inside the transport's loop."""
    peers = sorted(paths_bytes_per_s, key=lambda p: (-paths_bytes_per_s[p], p))[: config.max_peers]
    if len(peers) < config.min_peers:
        reason = f"{len(peers)} peers measured, fewer than {config.min_peers}"
        return {d: AccessEstimate(None, reason) for d in Direction}
    deadline_s = time.monotonic() + config.deadline_s
    try:
        async with AsyncExitStack() as stack:
            sessions = [await stack.enter_async_context(transport.open_probe(p)) for p in peers]
            run = _Run(sessions, config, deadline_s, stop or (lambda: False), transport.config)
            guesses = [paths_bytes_per_s[p] for p in peers]
            return {d: await run.checked(d, guesses) for d in Direction}
    except _Stopped:
        logger.debug("stopped measuring the access link")
        return None


class _Run:
    """One measurement's sessions, budgets and deadline."""

    def __init__(self, sessions: Sequence[ProbeSession], config: AccessConfig, deadline_s: float,
                 stop: Callable[[], bool], transport_config) -> None:  # fmt: skip
        self.sessions, self.config, self.deadline_s, self.stop = sessions, config, deadline_s, stop
        self.call_timeout_s = transport_config.call_timeout_s
        self.max_pull_bytes = transport_config.max_probe_reply_bytes

    async def checked(self, direction: Direction, guesses: Sequence[float]) -> AccessEstimate:
        """One direction; a peer that fails it (left, timed out, refused a pull) makes it unknown, not the other."""
        try:
            return await self.direction(direction, guesses)
        except ProtocolError as e:
            logger.warning("measuring our %s failed: %s; unknown until the next measurement", direction.value, e)
            return AccessEstimate(None, f"failed: {e}")

    async def direction(self, direction: Direction, guesses: Sequence[float]) -> AccessEstimate:
        config = self.config
        pings = await _all([self._pings(s) for s in self.sessions])
        floors = [min(_delay(t, direction) for t in trips) for trips in pings]
        rtt_s = max(min(t.rtt_s for t in trips) for trips in pings)
        flow_s = min(max(config.flow_s, config.rtt_multiple * rtt_s), config.max_transfer_s)
        singles = []
        for session, floor_s, guess in zip(self.sessions, floors, guesses, strict=True):
            singles.append(await self._single(session, direction, floor_s, guess, flow_s))
        sizes = self._sizes(singles, flow_s, direction)
        aggregates = []
        for _ in range(config.tries):
            serial = await _all([self._timed(s, direction, n, f)
                                 for s, n, f in zip(self.sessions, sizes, floors, strict=True)])  # fmt: skip
            aggregates.append(sum(sizes) / max(max(serial), MIN_SERIAL_S))
        estimate = estimate_access(singles, aggregates, config)
        logger.info("%s: %s (paths alone %s Mbit/s, at once %s Mbit/s, flows of %.2f s): %s", direction.value,
                    "unknown" if estimate.gbps is None else f"{estimate.gbps * 1e3:.2f} Mbit/s",
                    "/".join(f"{b * 8 / 1e6:.1f}" for b in singles), "/".join(f"{a * 8 / 1e6:.1f}" for a in aggregates),
                    flow_s, estimate.reason)  # fmt: skip
        return estimate

    def _sizes(self, rates: Sequence[float], flow_s: float, direction: Direction) -> list[int]:
        """Each flow's bytes: rate × T within the per-flow and total budgets."""
        cap = self.config.max_transfer_bytes if direction is Direction.UP else min(self.config.max_transfer_bytes,
                                                                                    self.max_pull_bytes)  # fmt: skip
        sizes = [max(1, min(int(r * flow_s), cap)) for r in rates]
        scale = min(1.0, self.config.max_total_bytes / sum(sizes))
        return [max(1, int(n * scale)) for n in sizes]

    async def _pings(self, session: ProbeSession) -> list[RoundTrip]:
        return [await self._trip(session, 0, 0) for _ in range(self.config.pings)]

    async def _single(self, session: ProbeSession, direction: Direction, floor_s: float, guess: float,
                      flow_s: float) -> float:  # fmt: skip
        """A path's rate alone: resized once from ``guess`` if its first transfer took under half of T."""
        size = self._sizes([guess], flow_s, direction)[0]
        serial_s = await self._timed(session, direction, size, floor_s)
        if serial_s < flow_s / 2:
            size = self._sizes([size / serial_s], flow_s, direction)[0]
            serial_s = await self._timed(session, direction, size, floor_s)
        for _ in range(self.config.tries - 1):
            serial_s = min(serial_s, await self._timed(session, direction, size, floor_s))
        return size / serial_s

    async def _timed(self, session: ProbeSession, direction: Direction, size: int, floor_s: float) -> float:
        """Seconds a transfer of ``size`` took beyond its path's floor (pushed up, or pulled down)."""
        trip = await (self._trip(session, size, 0) if direction is Direction.UP else self._trip(session, 0, size))
        return max(_delay(trip, direction) - floor_s, MIN_SERIAL_S)

    async def _trip(self, session: ProbeSession, request_bytes: int, reply_bytes: int) -> RoundTrip:
        if self.stop():
            raise _Stopped
        left_s = min(self.deadline_s - time.monotonic(), self.call_timeout_s)
        if left_s <= 0:
            raise PeerTimeoutError(f"the access probe did not finish within {self.config.deadline_s:.1f} s",
                                   peer=session.peer)  # fmt: skip
        return await session.roundtrip(request_bytes, reply_bytes, timeout_s=left_s)


async def _all(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coroutines`` at once; the first failure cancels the others (none is left running) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _delay(trip: RoundTrip, direction: Direction) -> float:
    """A push's one-way delay when the peer reports arrivals (the reply's way back left out), else its round
    trip; a pull's round trip (its bytes come back)."""
    if direction is Direction.UP and trip.one_way_s is not None:
        return trip.one_way_s
    return trip.rtt_s
