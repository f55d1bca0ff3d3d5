"""Measuring a link's latency α and bandwidth β over the transport's own rpc, so emulation applies, on the path the
peer's tensors take (``probe_session``: the direct data plane where it reaches the peer, else libp2p).

Method (``measure_link``), on one probe stream to the peer. Each probe is timed two ways (``RoundTrip``):
its round trip, and its one-way delay — the replier's arrival time of the request minus our send time.
The one-way delay leaves out the reply's way back (which queues behind the peer's own probes of us, and
waits for both peers to be scheduled) and, under emulation, a late wake-up on either side (the arrival is
the request's stamp when its bytes were in by then). Both sums carry only delays that add time, so the
smallest samples are the least disturbed; below, a "delay" is the one-way delay when the peer reports
arrivals, else the round trip.

1. ``pings`` empty probes: α = the smallest one-way delay when both clocks are one (one machine), else the
   smallest RTT / 2.
2. Transfers of n bytes take a delay of (their ping's) + n/β, so β = n / (delay − the smallest ping delay);
   on other machines the clocks' offset cancels in that difference. The size adapts: starting at
   ``first_transfer_bytes`` it grows until a transfer's n/β takes at least ``rtt_multiple`` × RTT and
   ``min_transfer_s`` (so RTT and timer noise are small against it), but not beyond ``max_transfer_s`` or
   ``max_transfer_bytes``, so a slow link does not take forever, and at most ``MAX_GROWTH`` times at a step
   (a transfer lost in the timer's noise gives no rate to size the next by).
3. Then at least ``transfers`` transfers of that size, each followed by a ping; the fastest counts. A busy
   machine delays many samples (half of them, on two cores running eight agents), by different amounts:
   undisturbed samples agree, disturbed ones rarely do. So while the fastest ``transfers`` transfers, or
   the fastest two pings, spread over more than the tolerance × n/β, another transfer and ping follow, up
   to ``max_transfers``; then the fastest still counts, flagged (``LinkEstimate.agreed``) and logged. The
   tolerance is ``agreement`` for the first ``transfers`` transfers and grows by ``agreement_growth`` with
   each one after, up to ``loosest_agreement``: the fastest sample is what counts, and agreement only
   vouches that it is undisturbed; on a machine busy enough that the fastest three rarely lie within 2 %,
   the tail to ``max_transfers`` was most of a measurement's time (16 agents on two cores: 3.9 s at nine
   and ten transfers against 1.1 s at three), while the samples that agreed within 2 % after six or more
   transfers were within 1 % of the emulated link all the same.
4. All of it under ``deadline_s``; every round trip under the transport's call deadline. A ``stop`` callable
   (the prober's pause) is asked before every round trip: once it says so, the measurement ends, no result.

Repeated measurements are smoothed per peer by ``LinkTable`` (EWMA), which is what an agent publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from p2ptrain.errors import PeerTimeoutError

if TYPE_CHECKING:
    from p2ptrain.net.transport.endpoint import PeerLike, Transport
    from p2ptrain.net.transport.probe_session import ProbeSession, RoundTrip

logger = logging.getLogger(__name__)

BITS_PER_BYTE = 8
MIN_SERIAL_S = 1e-6  # a transfer faster than this is below what we can time
# a transfer is at most this many times the last (step 2): a last one lost in the timer's noise says only that the
# link is fast, not how fast (64 KiB timed at a microsecond on a loaded machine once grew to 64 MiB, 100 s of a
# 5 Mbit/s link, and the measurement hung past its deadline)
MAX_GROWTH = 4


@dataclass(frozen=True)
class ProbeConfig:
    pings: int = 8
    transfers: int = 3  # at least this many transfers of the final size; the fastest this many must agree
    max_transfers: int = 10  # more transfers (and pings) while they do not (module docstring)
    agreement: float = 0.02  # share of the transfer time n/β within which agreeing samples lie
    agreement_growth: float = 1.5  # the share grows by this factor with each transfer past ``transfers``
    loosest_agreement: float = 0.1  # up to this share
    first_transfer_bytes: int = 64 << 10
    max_transfer_bytes: int = 64 << 20
    rtt_multiple: float = 10.0
    min_transfer_s: float = 0.2
    max_transfer_s: float = 2.0
    deadline_s: float = 60.0

    def __post_init__(self):
        if self.pings < 2 or self.transfers < 2 or self.max_transfers < self.transfers:
            raise ValueError("pings and transfers must be at least 2 (two samples to compare), max_transfers >= transfers")
        if not 0 < self.agreement <= self.loosest_agreement < 1 or self.agreement_growth < 1:
            raise ValueError(f"need 0 < agreement <= loosest_agreement < 1 and agreement_growth >= 1, got "
                             f"{self.agreement}, {self.loosest_agreement}, {self.agreement_growth}")
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
    agreed: bool = True  # the fastest samples agreed (see the module docstring); else a best guess


def measure_link(
    transport: Transport, peer: PeerLike, config: ProbeConfig | None = None, stop: Callable[[], bool] | None = None
) -> LinkEstimate | None:
    """Measure α and β to ``peer`` (blocking); PeerTimeoutError naming it past ``ProbeConfig.deadline_s``; None
    once ``stop()`` (asked between round trips, from the transport's loop) says to stop."""
    config = config or ProbeConfig()
    return transport.run_coroutine(ameasure_link(transport, peer, config, stop), config.deadline_s + 5.0)


async def ameasure_link(
    transport: Transport, peer: PeerLike, config: ProbeConfig | None = None, stop: Callable[[], bool] | None = None
) -> LinkEstimate | None:
    """``measure_link`` inside the transport's loop."""
    config = config or ProbeConfig()
    async with transport.open_probe(peer) as session:
        return await ameasure_session(session, config, stop)


class _Stopped(Exception):
    pass


async def ameasure_session(
    session: ProbeSession, config: ProbeConfig, stop: Callable[[], bool] | None = None
) -> LinkEstimate | None:
    """The method of the module docstring, on an open probe stream (anything with ``peer``, ``Transport.config``
    and ``roundtrip`` as ``ProbeSession`` has them)."""
    try:
        return await _measure(session, config, stop or (lambda: False))
    except _Stopped:
        logger.debug("stopped measuring the link to peer %s", session.peer)
        return None


async def _measure(session: ProbeSession, config: ProbeConfig, stop: Callable[[], bool]) -> LinkEstimate:
    peer = session.peer
    call_timeout_s = session.transport.config.call_timeout_s
    begin_s = time.monotonic()
    deadline_s = begin_s + config.deadline_s

    async def probe(size: int) -> RoundTrip:
        if stop():
            raise _Stopped
        left_s = min(deadline_s - time.monotonic(), call_timeout_s)
        if left_s <= 0:
            raise PeerTimeoutError(f"link probe did not finish within {config.deadline_s:.1f} s", peer=peer)
        return await session.roundtrip(size, timeout_s=left_s)

    pings = [await probe(0) for _ in range(config.pings)]
    rtt_s = min(p.rtt_s for p in pings)
    target_s = max(config.rtt_multiple * rtt_s, config.min_transfer_s)
    size = config.first_transfer_bytes
    while True:
        transfer = await probe(size)
        both = [*pings, transfer]
        serial_s = max(_delay(transfer, both) - min(_delay(p, both) for p in pings), MIN_SERIAL_S)
        logger.debug("probe of %d bytes to peer %s: %.4f s after the fastest ping", size, peer, serial_s)
        if serial_s >= 0.8 * target_s or size >= config.max_transfer_bytes:
            break
        rate = size / serial_s
        grown = min(max(2 * size, int(rate * target_s * 1.1)), MAX_GROWTH * size)
        size = min(grown, config.max_transfer_bytes, max(int(rate * config.max_transfer_s), size + 1))
    transfers = [transfer]
    while len(transfers) < config.transfers or (
        not _agree(transfers, pings, config) and len(transfers) < config.max_transfers
    ):
        transfers.append(await probe(size))
        pings.append(await probe(0))
    agreed = _agree(transfers, pings, config)
    samples = pings + transfers
    floor_s = min(_delay(p, samples) for p in pings)
    serial_s = max(min(_delay(t, samples) for t in transfers) - floor_s, MIN_SERIAL_S)
    one_way = all(s.one_way_s is not None and s.same_clock for s in samples)
    latency_s = floor_s if one_way else min(p.rtt_s for p in pings) / 2
    estimate = LinkEstimate(
        latency_ms=latency_s * 1e3,
        bandwidth_gbps=size / serial_s * BITS_PER_BYTE / 1e9,
        samples=len(samples),
        agreed=agreed,
    )
    logger.info("link to peer %s: %.2f ms, %.4f Gbit/s (%d round trips, %d transfers of %d bytes %s, %s, %.2f s)",
                peer, estimate.latency_ms, estimate.bandwidth_gbps, estimate.samples, len(transfers), size,
                f"within {tolerance(config, len(transfers)):.1%}" if agreed else "that disagreed",
                "one-way" if one_way else "round trips",
                time.monotonic() - begin_s)
    return estimate


def _delay(sample: RoundTrip, samples: Sequence[RoundTrip]) -> float:
    """The sample's one-way delay when every sample has one (so that they compare), else its round trip."""
    one_way = sample.one_way_s is not None and all(s.one_way_s is not None for s in samples)
    return sample.one_way_s if one_way else sample.rtt_s


def _agree(transfers: Sequence[RoundTrip], pings: Sequence[RoundTrip], config: ProbeConfig) -> bool:
    """Whether the fastest ``ProbeConfig.transfers`` transfers, and the fastest two pings, lie within the
    tolerance (``tolerance``) × n/β. Two disturbed samples may agree by chance; three rarely do."""
    samples = [*transfers, *pings]
    fast_transfers = sorted(_delay(t, samples) for t in transfers)[: config.transfers]
    fast_pings = sorted(_delay(p, samples) for p in pings)[:2]
    tolerance_s = tolerance(config, len(transfers)) * max(fast_transfers[0] - fast_pings[0], MIN_SERIAL_S)
    return (len(fast_transfers) == config.transfers and fast_transfers[-1] - fast_transfers[0] <= tolerance_s
            and fast_pings[1] - fast_pings[0] <= tolerance_s)


def tolerance(config: ProbeConfig, transfers: int) -> float:
    """The share of n/β within which the fastest samples must lie after ``transfers`` transfers (module
    docstring, step 3)."""
    extra = max(0, transfers - config.transfers)
    return min(config.agreement * config.agreement_growth ** extra, config.loosest_agreement)


class LinkTable:
    """Smoothed link estimates per peer: an exponentially weighted moving average over measurements.

    Latency is averaged as is; bandwidth through its inverse (seconds per bit), which is what adds up in
    transfer times, so one slow measurement weighs as much as it costs. A measurement whose samples did not
    agree (``LinkEstimate.agreed``) stands in only until an agreed one comes, which replaces it: one
    disturbed measurement does not pull an average that took several good ones.
    """

    def __init__(self, weight: float = 0.3):
        if not 0 < weight <= 1:
            raise ValueError(f"EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._estimates: dict[str, LinkEstimate] = {}

    def update(self, peer: PeerLike, estimate: LinkEstimate) -> LinkEstimate:
        old = self._estimates.get(str(peer))
        if old is not None and old.agreed and not estimate.agreed:
            return old
        if old is not None and old.agreed:
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
