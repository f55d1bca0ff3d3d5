"""Measuring a link's latency α and bandwidth β over the transport's own rpc, so emulation applies.

Method (``measure_link``), on one probe stream to the peer:

1. ``pings`` empty round trips: RTT = α_ab + α_ba, and α ≈ min RTT / 2. Delays on the path (scheduling,
   a busy link) only ever add time, so the minimum is the least disturbed sample.
2. Bulk transfers of n bytes answered by an empty reply take RTT + n/β, so β = n / (T − RTT). The size
   adapts: starting at ``first_transfer_bytes`` it grows until a transfer's n/β takes at least
   ``rtt_multiple`` × RTT and ``min_transfer_s`` (so RTT and timer noise are small against it), but not
   beyond ``max_transfer_s`` or ``max_transfer_bytes``, so a slow link does not take forever. Then
   ``transfers`` transfers of that size; the fastest counts, for the same reason as the minimum RTT.
3. All of it under ``deadline_s``; every round trip under the transport's call deadline.

Repeated measurements are smoothed per peer by ``LinkTable`` (EWMA), which is what an agent publishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from p2ptrain.errors import PeerTimeoutError

if TYPE_CHECKING:
    from p2ptrain.net.transport import PeerLike, Transport

logger = logging.getLogger(__name__)

BITS_PER_BYTE = 8
MIN_SERIAL_S = 1e-6  # a transfer faster than this is below what we can time


@dataclass(frozen=True)
class ProbeConfig:
    pings: int = 8
    transfers: int = 3
    first_transfer_bytes: int = 64 << 10
    max_transfer_bytes: int = 64 << 20
    rtt_multiple: float = 10.0
    min_transfer_s: float = 0.2
    max_transfer_s: float = 2.0
    deadline_s: float = 60.0

    def __post_init__(self):
        if self.pings < 1 or self.transfers < 1:
            raise ValueError("pings and transfers must be at least 1")
        if not 0 < self.first_transfer_bytes <= self.max_transfer_bytes:
            raise ValueError("first_transfer_bytes must be positive and at most max_transfer_bytes")
        if not 0 < self.min_transfer_s <= self.max_transfer_s or self.rtt_multiple < 0 or self.deadline_s <= 0:
            raise ValueError("need 0 < min_transfer_s <= max_transfer_s, rtt_multiple >= 0, deadline_s > 0")


@dataclass(frozen=True)
class LinkEstimate:
    """One-way latency and bandwidth of the link to a peer, in the units of the cluster file and records."""

    latency_ms: float
    bandwidth_gbps: float
    samples: int  # round trips behind the estimate (summed over smoothed measurements)


def measure_link(transport: Transport, peer: PeerLike, config: ProbeConfig | None = None) -> LinkEstimate:
    """Measure α and β to ``peer`` (blocking); PeerTimeoutError naming it past ``config.deadline_s``."""
    config = config or ProbeConfig()
    return transport.run_coroutine(ameasure_link(transport, peer, config), config.deadline_s + 5.0)


async def ameasure_link(transport: Transport, peer: PeerLike, config: ProbeConfig | None = None) -> LinkEstimate:
    """``measure_link`` inside the transport's loop."""
    config = config or ProbeConfig()
    peer = str(peer)
    deadline_s = time.monotonic() + config.deadline_s

    def remaining_s() -> float:
        left_s = min(deadline_s - time.monotonic(), transport.config.call_timeout_s)
        if left_s <= 0:
            raise PeerTimeoutError(f"link probe did not finish within {config.deadline_s:.1f} s", peer=peer)
        return left_s

    async with transport.open_probe(peer) as session:
        rtts_s = [await session.roundtrip(0, timeout_s=remaining_s()) for _ in range(config.pings)]
        rtt_s = min(rtts_s)
        target_s = max(config.rtt_multiple * rtt_s, config.min_transfer_s)
        size = config.first_transfer_bytes
        while True:
            elapsed_s = await session.roundtrip(size, timeout_s=remaining_s())
            serial_s = max(elapsed_s - rtt_s, MIN_SERIAL_S)
            logger.debug("probe of %d bytes to peer %s took %.4f s", size, peer, elapsed_s)
            if serial_s >= 0.8 * target_s or size >= config.max_transfer_bytes:
                break
            rate = size / serial_s
            grown = max(2 * size, int(rate * target_s * 1.1))
            size = min(grown, config.max_transfer_bytes, max(int(rate * config.max_transfer_s), size + 1))
        transfers_s = [elapsed_s]
        for _ in range(config.transfers - 1):
            transfers_s.append(await session.roundtrip(size, timeout_s=remaining_s()))
            rtts_s.append(await session.roundtrip(0, timeout_s=remaining_s()))
    rtt_s = min(rtts_s)
    serial_s = max(min(transfers_s) - rtt_s, MIN_SERIAL_S)
    estimate = LinkEstimate(
        latency_ms=rtt_s / 2 * 1e3,
        bandwidth_gbps=size / serial_s * BITS_PER_BYTE / 1e9,
        samples=len(rtts_s) + len(transfers_s),
    )
    logger.info("link to peer %s: %.2f ms, %.4f Gbit/s (%d round trips, transfers of %d bytes)",
                peer, estimate.latency_ms, estimate.bandwidth_gbps, estimate.samples, size)
    return estimate


class LinkTable:
    """Smoothed link estimates per peer: an exponentially weighted moving average over measurements.

    Latency is averaged as is; bandwidth through its inverse (seconds per bit), which is what adds up in
    transfer times, so one slow measurement weighs as much as it costs.
    """

    def __init__(self, weight: float = 0.3):
        if not 0 < weight <= 1:
            raise ValueError(f"EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._estimates: dict[str, LinkEstimate] = {}

    def update(self, peer: PeerLike, estimate: LinkEstimate) -> LinkEstimate:
        old = self._estimates.get(str(peer))
        if old is not None:
            w = self.weight
            estimate = replace(
                estimate,
                latency_ms=(1 - w) * old.latency_ms + w * estimate.latency_ms,
                bandwidth_gbps=1 / ((1 - w) / old.bandwidth_gbps + w / estimate.bandwidth_gbps),
                samples=old.samples + estimate.samples,
            )
        self._estimates[str(peer)] = estimate
        return estimate

    def get(self, peer: PeerLike) -> LinkEstimate | None:
        return self._estimates.get(str(peer))

    def forget(self, peer: PeerLike) -> None:
        self._estimates.pop(str(peer), None)

    def snapshot(self) -> dict[str, LinkEstimate]:
        return dict(self._estimates)
