"""Measuring this peer's access link: the uplink and the downlink that all of its flows share (a home's line).

A pair's probe (``probe.py``) times one path alone: the slowest of our uplink, the path and the peer's
downlink, so one probe cannot tell our line from the path. The line is what flows share, so it shows when
several run at once. For each direction, over the k fastest peers by their pair probes
(``AccessConfig.min_peers`` ≤ k ≤ ``max_peers``), each on a probe stream of its own:

1. ``pings`` empty probes per peer: each path's floor, the smallest delay of an empty probe.
2. Singles: each peer alone, the fastest of ``tries`` transfers: b_i = n / (delay − floor). The first is of
   at most ``first_transfer_bytes`` (a path's rate one way says little of the other: a home's 12 Mbit/s
   uplink behind a peer we reach at 1 Gbit/s), then n grows to b_i × T (T: the flow time) while a transfer
   takes under half of T. Uplink: we send n bytes (a push, as the pair probe; the delay is the one-way delay
   when the peer reports arrivals); downlink: the peer sends them (a pull: a probe asking for n bytes back;
   the round trip).
3. A path whose flow of T would exceed the per-flow budget is left out: faster than the budget measures.
   The aggregate: the others all at once, each flow n_i = b_i × T (scaled down alike to the total budget);
   D = max_i (delay_i − floor_i), the smallest of ``tries`` (the least disturbed), A = Σ n_i / D. A flow that
   went ``UNDERSTATED`` times faster at once than its path alone shows that single was disturbed: it is
   measured again (the larger rate kept), and the flows at once after it.
4. ``estimate_access`` (pure): without a shared bottleneck the flows end when the slowest alone would,
   D ≈ D₀ = max_i n_i / b_i, and A ≈ Σ n_i / D₀ (Σ b_i when every flow takes T): the line carries at least
   that, but how much more is not measured, so the answer is *unknown*. When A is at most ``shared_share`` ×
   Σ n_i / D₀, and with three flows or more each flow too kept little of its own pace alone (the mean over
   the flows of (n_i / b_i) / delay_i, in the try where it is highest, at most ``per_flow_limit``: a line they
   share slows every flow, while a moment's disturbance of one flow — another process on a busy CPU — slows
   that one and, through D, A: *disturbed*, unknown; two flows cannot tell the two apart), the
   flows queued in something they share: not the peers' lines (each carries one flow, and its
   single b_i already had it) but ours; the line carried A with the flows keeping it busy, and each b_i
   alone, so its capacity is max(A, max b_i). Fewer than ``min_peers`` peers, or an A below
   ``disturbed_share`` × max b_i (slower than one path alone: the measurement was disturbed), is unknown
   too. A is a lower bound: a FIFO line that a flow left early idles for the rest.

T = max(``flow_s``, ``rtt_multiple`` × the slowest ping's round trip), at most ``max_transfer_s``; each flow
at most ``max_transfer_bytes`` (pulls: also the transport's ``max_probe_reply_bytes``), all of them together
at most ``max_total_bytes``: at the defaults, paths over about 500 Mbit/s are left out and lines over about
1 Gbit/s stay unknown (on such lines a machine's CPU is often what its flows share). So the line is kept full
for about k × T once per try (a 10 Mbit/s uplink, 4 peers: 2 s at the defaults), the whole measurement (both
directions) under ``deadline_s``, every round trip under the transport's call deadline, and ``stop`` (the
prober's pause) asked between steps ends it without a result.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from p2ptrain.errors import MessageRejected, PeerTimeoutError, ProtocolError
from p2ptrain.net.transport.messages import Refusal

if TYPE_CHECKING:
    from p2ptrain.net.transport.endpoint import Transport
    from p2ptrain.net.transport.probe_session import ProbeSession, RoundTrip

logger = logging.getLogger(__name__)

BITS_PER_BYTE = 8
MIN_SERIAL_S = 1e-6  # a transfer faster than this is below what we can time
UNDERSTATED = 1.25  # a flow at once this much faster than its path alone: that single was disturbed
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
    first_transfer_bytes: int = 256 << 10  # a single's first transfer, at most
    max_transfer_bytes: int = 32 << 20
    max_total_bytes: int = 64 << 20  # all flows of one aggregate together
    shared_share: float = 0.7  # A at most this share of what the flows carry alone (Σ n_i / D₀): ours is shared
    disturbed_share: float = 0.5  # A under this share of the fastest single: disturbed, unknown
    deadline_s: float = 60.0  # both directions
    refresh_s: float = 600.0  # measured again after this long (the pair probes' refresh_s is shorter)
    retry_s: float = 30.0  # ... or after this long when it failed, or a direction not yet known came out disturbed
    retries: int = 3  # disturbed directions measured again at most this many times in a row, then at refresh_s

    def __post_init__(self):
        if not 2 <= self.min_peers <= self.max_peers:
            raise ValueError(f"need 2 <= min_peers <= max_peers, got {self.min_peers} and {self.max_peers}")
        if self.pings < 1 or self.tries < 1:
            raise ValueError("pings and tries must be at least 1")
        if not 0 < self.flow_s <= self.max_transfer_s or self.rtt_multiple < 0:
            raise ValueError("need 0 < flow_s <= max_transfer_s and rtt_multiple >= 0")
        if not 0 < self.first_transfer_bytes <= self.max_transfer_bytes <= self.max_total_bytes:
            raise ValueError("need 0 < first_transfer_bytes <= max_transfer_bytes <= max_total_bytes")
        if not 0 < self.disturbed_share < 1 or not 0 < self.shared_share < 1:
            raise ValueError("shared_share and disturbed_share must be shares in (0, 1)")
        if not self.deadline_s > 0 or self.refresh_s < 0:
            raise ValueError("deadline_s must be positive and refresh_s >= 0")
        if not self.retry_s > 0 or self.retries < 0:
            raise ValueError("retry_s must be positive and retries >= 0")


@dataclass(frozen=True)
class AccessEstimate:
    """One direction of the line: its capacity (bytes/s), or None (unknown) with the reason; ``disturbed``: unknown
    because this measurement went wrong (a busy moment, a peer that failed it), not because of what it found."""

    capacity_bytes_per_s: float | None
    reason: str
    disturbed: bool = False

    @property
    def gbps(self) -> float | None:
        return None if self.capacity_bytes_per_s is None else self.capacity_bytes_per_s * BITS_PER_BYTE / 1e9


def estimate_access(
    singles_bytes_per_s: Sequence[float], sizes_bytes: Sequence[int], flows_s: Sequence[Sequence[float]],
    config: AccessConfig,
) -> AccessEstimate:
    """The line's capacity from each path's rate alone (b_i), the bytes each flow carried at once (n_i) and how
    long each flow took at once (``flows_s``: per try, one delay per flow; D is a try's longest), or unknown;
    the rule is the module docstring's step 4."""
    if len(singles_bytes_per_s) < config.min_peers:
        return AccessEstimate(None, f"{len(singles_bytes_per_s)} peers measured, fewer than {config.min_peers}")
    if len(sizes_bytes) != len(singles_bytes_per_s):
        raise ValueError(f"{len(sizes_bytes)} flow sizes for {len(singles_bytes_per_s)} paths")
    if any(len(delays) != len(sizes_bytes) for delays in flows_s):
        raise ValueError(f"a try of the flows at once has not one delay for each of the {len(sizes_bytes)} flows")
    if not flows_s:
        return AccessEstimate(None, "no aggregate measured")
    alone = [n / b for n, b in zip(sizes_bytes, singles_bytes_per_s, strict=True)]
    total_bytes, fastest = sum(sizes_bytes), max(singles_bytes_per_s)
    aggregate = total_bytes / max(min(max(delays) for delays in flows_s), MIN_SERIAL_S)
    share = aggregate / (total_bytes / max(alone))
    # each flow's own pace at once against its pace alone, in the least disturbed try: a line they share slows
    # every flow; a moment's disturbance, one of them (which the slowest flow's D alone would take for a line)
    each = max(statistics.fmean(a / max(d, MIN_SERIAL_S) for a, d in zip(alone, delays, strict=True))
               for delays in flows_s)
    flows = len(singles_bytes_per_s)
    if share > config.shared_share:
        return AccessEstimate(None, f"no shared bottleneck: {flows} flows at once carried {share:.0%} of their "
                                    f"rates alone, each flow {each:.0%} of its own")
    if each > per_flow_limit(flows, config.shared_share):  # the slowest flow held back, the others at their pace
        return AccessEstimate(None, f"disturbed: {flows} flows at once carried {share:.0%} of their rates alone, "
                                    f"but each flow {each:.0%} of its own", disturbed=True)
    if aggregate < config.disturbed_share * fastest:
        return AccessEstimate(None, f"disturbed: the flows at once carried {aggregate / fastest:.0%} of the "
                                    "fastest path alone", disturbed=True)
    return AccessEstimate(max(aggregate, fastest), f"{flows} flows at once carried {share:.0%} of their rates alone")


def per_flow_limit(flows: int, shared_share: float) -> float:
    """The most each flow may keep of its own pace alone, on the mean, for ``flows`` flows to have shared a line:
    the midpoint of what a shared line leaves them when it serves them first come, first served (the first at
    its pace, the second at half, …: H_k / k on the mean, less when it interleaves them) and what one flow held
    back leaves the others ((k − 1) / k at least), and ``shared_share`` at most. Two flows cannot tell the two
    apart (one held back to half its pace is a line serving them in turn): their aggregate alone decides."""
    if flows < 3:
        return 1.0
    served_in_turn = sum(1 / i for i in range(1, flows + 1)) / flows
    return min(shared_share, (served_in_turn + (flows - 1) / flows) / 2)


def understated_singles(singles_bytes_per_s: Sequence[float], sizes_bytes: Sequence[int],
                        flows_s: Sequence[Sequence[float]]) -> list[int]:
    """The paths whose flow went ``UNDERSTATED`` times faster at once (in some try) than their single said."""
    return [i for i, b in enumerate(singles_bytes_per_s)
            if max(sizes_bytes[i] / max(delays[i], MIN_SERIAL_S) for delays in flows_s) > UNDERSTATED * b]


class _Stopped(Exception):
    pass


def measure_access(
    transport: Transport, paths_bytes_per_s: Mapping[str, float], config: AccessConfig | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[Direction, AccessEstimate] | None:
    """Both directions of our line (blocking), from the peers ``paths_bytes_per_s`` names with their pair
    probes' rates; None once ``stop()`` says to stop. A direction that a peer fails (it left, timed out, refused a
    pull), or that ran past ``AccessConfig.deadline_s``, is unknown with the reason; a peer that cannot be reached
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
            return {d: await run.checked(d) for d in Direction}
    except _Stopped:
        logger.debug("stopped measuring the access link")
        return None


class _Run:
    """One measurement's sessions, budgets and deadline."""

    def __init__(self, sessions: Sequence[ProbeSession], config: AccessConfig, deadline_s: float,
                 stop: Callable[[], bool], transport_config) -> None:
        self.sessions, self.config, self.deadline_s, self.stop = sessions, config, deadline_s, stop
        self.call_timeout_s = transport_config.call_timeout_s
        self.max_pull_bytes = transport_config.max_probe_reply_bytes

    async def checked(self, direction: Direction) -> AccessEstimate:
        """One direction; a peer that fails it (left, timed out, refused a pull) makes it unknown, not the other."""
        try:
            return await self.direction(direction)
        except ProtocolError as e:
            if isinstance(e, MessageRejected) and e.code == Refusal.BUSY:  # a peer in another measurement
                raise  # (``probe_gate``): the prober measures again shortly
            logger.warning("measuring our %s failed: %s; unknown until the next measurement", direction.value, e)
            return AccessEstimate(None, f"failed: {e}", disturbed=True)

    async def direction(self, direction: Direction) -> AccessEstimate:
        config = self.config
        pings = await _all([self._pings(s) for s in self.sessions])
        floors = [min(_delay(t, direction) for t in trips) for trips in pings]
        rtt_s = max(min(t.rtt_s for t in trips) for trips in pings)
        flow_s = min(max(config.flow_s, config.rtt_multiple * rtt_s), config.max_transfer_s)
        singles = []
        for session, floor_s in zip(self.sessions, floors, strict=True):
            singles.append(await self._single(session, direction, floor_s, flow_s))
        cap = self._cap(direction)
        kept = [i for i, b in enumerate(singles) if b * flow_s <= cap]  # the others: faster than the budget measures
        if len(kept) < config.min_peers:
            estimate = AccessEstimate(None, f"{len(singles) - len(kept)} of {len(singles)} paths faster than "
                                            f"{cap / flow_s * 8 / 1e6:.0f} Mbit/s, the budget's")
            logger.info("%s: unknown (paths alone %s Mbit/s): %s", direction.value,
                        "/".join(f"{b * 8 / 1e6:.1f}" for b in singles), estimate.reason)
            return estimate
        singles = [singles[i] for i in kept]
        sessions, floors = [self.sessions[i] for i in kept], [floors[i] for i in kept]
        sizes = self._sizes(singles, flow_s, direction)
        flows_s = await self._at_once(sessions, direction, sizes, floors)
        if understated := understated_singles(singles, sizes, flows_s):  # a flow went faster at once than its path alone: a disturbed single (a busy CPU), whose
            # small flow would hide a line the others share; measured again, and the flows at once after it
            logger.info("%s: path(s) %s alone measured slower than at once; measuring them again", direction.value,
                        ", ".join(str(i) for i in understated))
            for i in understated:
                singles[i] = max(singles[i], await self._single(sessions[i], direction, floors[i], flow_s))
            sizes = self._sizes(singles, flow_s, direction)
            flows_s = await self._at_once(sessions, direction, sizes, floors)
        estimate = estimate_access(singles, sizes, flows_s, config)
        logger.info("%s: %s (paths alone %s Mbit/s, at once %s Mbit/s, flows of %.2f s): %s", direction.value,
                    "unknown" if estimate.gbps is None else f"{estimate.gbps * 1e3:.2f} Mbit/s",
                    "/".join(f"{b * 8 / 1e6:.1f}" for b in singles),
                    "/".join(f"{sum(sizes) / max(d) * 8 / 1e6:.1f}" for d in flows_s), flow_s, estimate.reason)
        return estimate

    async def _at_once(self, sessions: Sequence[ProbeSession], direction: Direction, sizes: Sequence[int],
                       floors: Sequence[float]) -> list[list[float]]:
        """``tries`` rounds of every flow at once (module docstring, step 3): each flow's delay, per round."""
        return [await _all([self._timed(s, direction, n, f) for s, n, f in zip(sessions, sizes, floors, strict=True)])
                for _ in range(self.config.tries)]

    def _cap(self, direction: Direction) -> int:
        """The most one flow carries: a push, ``max_transfer_bytes``; a pull, also the peer's reply limit (ours)."""
        if direction is Direction.UP:
            return self.config.max_transfer_bytes
        return min(self.config.max_transfer_bytes, self.max_pull_bytes)

    def _sizes(self, rates: Sequence[float], flow_s: float, direction: Direction) -> list[int]:
        """Each flow's bytes: rate × T within the per-flow budget, all scaled down alike to the total one."""
        sizes = [max(1, min(int(r * flow_s), self._cap(direction))) for r in rates]
        scale = min(1.0, self.config.max_total_bytes / sum(sizes))
        return [max(1, int(n * scale)) for n in sizes]

    async def _pings(self, session: ProbeSession) -> list[RoundTrip]:
        return [await self._trip(session, 0, 0) for _ in range(self.config.pings)]

    async def _single(self, session: ProbeSession, direction: Direction, floor_s: float, flow_s: float) -> float:
        """A path's rate alone (module docstring, step 2)."""
        cap = self._cap(direction)
        size = min(self.config.first_transfer_bytes, cap)
        serial_s = await self._timed(session, direction, size, floor_s)
        while serial_s < flow_s / 2 and size < cap:
            size = min(max(int(size / serial_s * flow_s), 2 * size), cap)
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
                                   peer=session.peer)
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
