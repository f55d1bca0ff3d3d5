"""The link prober measures emulated links through the transport, also when scheduling delays disturb most
samples; smoothing; a deadline on a silent peer. Real transfers are judged by the stamps the transport computed
and reported, never by how long the machine took; the estimator's accuracy, on modelled round trips."""

from __future__ import annotations

import asyncio
import math
import random
import time
from types import SimpleNamespace

import pytest
from net_recorders import RecordingEmulator, RecordingPacer

from p2ptrain.errors import PeerTimeoutError
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.probe import (
    MAX_GROWTH,
    LinkEstimate,
    LinkTable,
    ProbeConfig,
    ameasure_session,
    measure_link,
)
from p2ptrain.net.transport.probe_session import ProbeSession, RoundTrip

# Sized so that a measurement takes a second or two: transfers of n/β ≥ max(3 RTT, 0.15 s), the fastest of 3.
QUICK = ProbeConfig(pings=10, transfers=3, rtt_multiple=3.0, min_transfer_s=0.15, deadline_s=30.0)
CONFIG = TransportConfig(call_timeout_s=5.0)


FAST = (5.0, 200.0)  # one-way latency (ms) and bandwidth (Mbit/s) of an emulated link
SLOW = (50.0, 20.0)  # ten times slower, both ways


def shape(a: Transport, b: Transport, latency_ms: float, bandwidth_mbit: float) -> None:
    """Emulate the link between ``a`` and ``b`` both ways: probes cross one, their replies the other."""
    for sender, receiver in ((a, b), (b, a)):
        sender.emulator.set_link(str(receiver.peer_id), latency_ms / 1e3, bandwidth_mbit * 1e6 / 8)


@pytest.fixture
def round_trips(monkeypatch) -> list[tuple[str, int, RoundTrip]]:
    """Every probe's round trip, in order: (peer, request bytes, what the session measured)."""
    trips: list[tuple[str, int, RoundTrip]] = []
    roundtrip = ProbeSession.roundtrip

    async def recorded(self, request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None) -> RoundTrip:
        trip = await roundtrip(self, request_bytes, reply_bytes, timeout_s)
        trips.append((self.peer, request_bytes, trip))
        return trip

    monkeypatch.setattr(ProbeSession, "roundtrip", recorded)
    return trips


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_probes_cross_the_emulated_links_and_the_replier_reports_their_stamps(make_transport, monkeypatch,
                                                                               round_trips):
    """Measuring a link and one ten times slower through real transports. Asserted on what the emulator
    computed and the replier reported, which load does not change: every probe crossed the link as a message
    of its size and its reply the way back; the replier got each probe's arrival stamp as the prober computed
    it and reported an arrival no earlier; so no delay the prober saw, nor the latency it estimated, is
    shorter than the link's, and the slower link measures slower. That the estimator recovers α and β exactly
    from such samples, also when most are late, is shown on modelled round trips below (``ModelSession``)."""
    monkeypatch.setattr("p2ptrain.net.transport.endpoint.Pacer", RecordingPacer)
    prober = make_transport(CONFIG, emulator=RecordingEmulator())
    fast = make_transport(CONFIG, join=prober, emulator=RecordingEmulator())
    slow = make_transport(CONFIG, join=prober, emulator=RecordingEmulator())
    estimates = {}
    for peer, (latency_ms, bandwidth_mbit) in ((fast, FAST), (slow, SLOW)):
        shape(prober, peer, latency_ms, bandwidth_mbit)
        estimate = measure_link(prober, peer.peer_id, QUICK)
        latency_s, bandwidth_bytes_per_s = latency_ms / 1e3, bandwidth_mbit * 1e6 / 8
        trips = [(size, trip) for to, size, trip in round_trips if to == str(peer.peer_id)]
        requests, replies = prober.emulator.to(peer.peer_id), peer.emulator.to(prober.peer_id)
        assert [b.size_bytes for b in requests] == [size for size, _ in trips]
        for b in requests:
            assert b.slot.arrive_s - b.slot.start_s == pytest.approx(latency_s + b.size_bytes / bandwidth_bytes_per_s)
        assert [b.size_bytes for b in replies] == [0] * len(trips)
        assert all(b.slot.arrive_s - b.slot.start_s == pytest.approx(latency_s) for b in replies)
        reports = peer.pacer.reports
        assert [r.stamp_s for r in reports] == [b.slot.arrive_s for b in requests]
        assert all(r.reported_s == max(r.stamp_s, r.read_s) for r in reports)
        for size, trip in trips:
            assert trip.same_clock and trip.one_way_s >= latency_s + size / bandwidth_bytes_per_s - 1e-9, (size, trip)
        assert QUICK.pings + QUICK.transfers <= estimate.samples <= len(trips)
        assert estimate.latency_ms >= latency_ms * (1 - 1e-9)
        assert 0 < estimate.bandwidth_gbps < math.inf
        estimates[peer] = estimate
    assert estimates[slow].latency_ms > estimates[fast].latency_ms
    assert estimates[slow].bandwidth_gbps < estimates[fast].bandwidth_gbps
    # every round trip is counted in the prober's control traffic, with its bytes both ways
    counted = prober.counters.snapshot()["probe"]
    assert counted["calls"] == len(round_trips) and counted["failures"] == 0
    assert counted["bytes"] == sum(b.size_bytes for peer in (fast, slow) for b in prober.emulator.to(peer.peer_id))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_probe_takes_the_path_the_peers_tensors_take(make_transport, monkeypatch):
    """To a peer the direct data plane reaches, the probes cross a sealed TCP connection that the peer serves as a
    probe stream (``TensorServicer.serve_direct``); to one without a direct plane, a libp2p stream: the link
    measured is the one its tensors will cross. The same emulated link both times, measured alike."""
    paths: list[tuple[str, bool]] = []
    enter = ProbeSession.__aenter__

    async def recorded(self):
        session = await enter(self)
        paths.append((self.peer, self.direct))
        return session

    monkeypatch.setattr(ProbeSession, "__aenter__", recorded)
    prober = make_transport(CONFIG, emulator=RecordingEmulator())
    direct = make_transport(CONFIG, join=prober)
    plain = make_transport(TransportConfig(call_timeout_s=5.0, direct=False), join=prober)
    accepted = direct.direct.accepted
    for peer in (direct, plain):
        shape(prober, peer, *FAST)
        estimate = measure_link(prober, peer.peer_id, QUICK)
        assert estimate.latency_ms >= FAST[0] * (1 - 1e-9) and 0 < estimate.bandwidth_gbps < math.inf
        assert max(b.size_bytes for b in prober.emulator.to(peer.peer_id)) > 0  # its transfers crossed the link
    assert set(paths) == {(str(direct.peer_id), True), (str(plain.peer_id), False)}
    assert direct.direct.accepted > accepted  # the peer proved and served a connection of the prober's
    assert prober.counters.snapshot()["probe"]["failures"] == 0


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_probing_a_silent_peer_ends_at_the_deadline(make_transport, deaf_transport_cls):
    silent = make_transport(TransportConfig(call_timeout_s=1.0), cls=deaf_transport_cls)
    prober = make_transport(TransportConfig(call_timeout_s=1.0), join=silent)
    start_s = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        measure_link(prober, silent.peer_id, ProbeConfig(deadline_s=2.0))
    assert info.value.peer == str(silent.peer_id)
    assert time.monotonic() - start_s < 10  # no hang
    assert prober.counters.snapshot().get("probe", {}).get("failures", 0) <= 1  # a stream never opened: no round trip


class LatePacer(RecordingPacer):
    """A pacer on a busy machine: a third of its waits end late, by 10-80 ms (a seeded draw)."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(7)

    def lateness(self) -> float:
        return self.rng.uniform(0.010, 0.080) if self.rng.random() < 1 / 3 else 0.0


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_late_wakeups_on_both_sides_do_not_count_in_the_delays_measured(make_transport, monkeypatch, round_trips):
    """Every paced send, every hold until a stamp and every reply of both peers may wake up late (a third
    do). The replier reports a probe's arrival from its stamp and from when its bytes were read, both known
    before its hold wakes: a late hold does not count. The prober's one-way delay ends at that report, so a
    reply late on its way back does not count either. (A sample whose bytes left late does count: the
    estimator's fastest-of-agreeing samples deal with it, see ``ModelSession`` below.)"""
    monkeypatch.setattr("p2ptrain.net.transport.endpoint.Pacer", LatePacer)
    a = make_transport(CONFIG, emulator=RecordingEmulator())
    b = make_transport(CONFIG, join=a, emulator=RecordingEmulator())
    assert isinstance(b.pacer, LatePacer)
    latency_ms, bandwidth_mbit = 10.0, 50.0
    shape(a, b, latency_ms, bandwidth_mbit)
    estimate = measure_link(b, a.peer_id, QUICK)
    holds, reports = a.pacer.holds, a.pacer.reports  # a's: the replier's
    requests, replies = b.emulator.to(a.peer_id), a.emulator.to(b.peer_id)
    assert len(holds) == len(reports) == len(requests) == len(replies) == len(round_trips) >= estimate.samples
    assert any(h.late_s > 0 for h in holds), "the seeded draws made no hold late"
    for i, (held, report, (_, _, trip)) in enumerate(zip(holds, reports, round_trips, strict=True)):
        assert held.stamp_s == report.stamp_s and report.read_s <= held.entered_s  # read, then held
        assert report.reported_s == max(report.stamp_s, report.read_s)  # fixed before the hold woke
        assert held.returned_s >= held.stamp_s + held.late_s - 1e-9  # the hold did wake that late
        assert replies[i].slot.start_s >= held.returned_s  # and the way back began after it
        # the one-way delay runs from the probe's send to the report: after the previous reply was in, before
        # the probe was booked on the link (so neither a late hold nor the way back is in it)
        sent_s = report.reported_s - trip.one_way_s
        assert sent_s <= requests[i].slot.start_s + 1e-9, (i, trip)
        assert i == 0 or sent_s >= replies[i - 1].slot.arrive_s - 1e-9, (i, trip)
    assert estimate.latency_ms >= latency_ms * (1 - 1e-9) and 0 < estimate.bandwidth_gbps < math.inf


class ModelSession:
    """A probe session over a modelled link, no network: a probe of n bytes arrives α + n/β after it is sent,
    plus a scheduling delay drawn from ``late``; its reply takes α + another draw. The replier's clock is
    ``offset_s`` ahead of ours; ``reports`` False: a replier that does not report arrivals."""

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float, late, offset_s: float = 0.0,
                 reports: bool = True):
        self.peer = "model"
        self.transport = SimpleNamespace(config=SimpleNamespace(call_timeout_s=5.0))
        self.latency_s, self.bandwidth_bytes_per_s, self.late = latency_s, bandwidth_bytes_per_s, late
        self.offset_s, self.reports = offset_s, reports
        self.sizes: list[int] = []

    async def roundtrip(self, request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None) -> RoundTrip:
        self.sizes.append(request_bytes)
        there_s = self.latency_s + request_bytes / self.bandwidth_bytes_per_s + self.late()
        back_s = self.latency_s + self.late()
        if not self.reports:
            return RoundTrip(there_s + back_s)
        return RoundTrip(there_s + back_s, there_s + self.offset_s, same_clock=self.offset_s == 0.0)


def late_draws(seed: int, share: float, most_s: float):
    rng = random.Random(seed)
    return lambda: rng.uniform(0.0, most_s) if rng.random() < share else 0.0


@pytest.mark.parametrize("seed", range(10))
def test_most_samples_delayed_still_give_the_link_exactly(seed):
    # 60% of the one-way trips and of the replies are late by up to 100 ms against a 0.15 s transfer: the
    # fastest of three would often be late; more transfers follow until the fastest two agree
    session = ModelSession(0.005, 2.5e6, late_draws(seed, share=0.6, most_s=0.100))
    estimate = asyncio.run(ameasure_session(session, QUICK))
    assert estimate.latency_ms == pytest.approx(5.0, rel=0.01)
    assert estimate.bandwidth_gbps == pytest.approx(0.020, rel=0.01)
    assert session.sizes.count(session.sizes[-2]) <= QUICK.max_transfers  # bounded


def test_a_quiet_link_costs_no_more_samples_than_the_configured_ones():
    session = ModelSession(0.005, 2.5e6, lambda: 0.0)
    estimate = asyncio.run(ameasure_session(session, QUICK))
    assert estimate.agreed and estimate.bandwidth_gbps == pytest.approx(0.020, rel=1e-6)
    transfers = [n for n in session.sizes if n > 0]
    assert transfers.count(transfers[-1]) == QUICK.transfers


def test_replies_late_on_the_way_back_do_not_count_when_the_replier_reports_arrivals():
    # every reply is late (the peer's own probes of us fill the way back): one-way times leave it out
    rng, draws = random.Random(3), [0]

    def late() -> float:  # the session draws for the way there, then for the way back
        draws[0] += 1
        return rng.uniform(0.02, 0.2) if draws[0] % 2 == 0 else 0.0

    estimate = asyncio.run(ameasure_session(ModelSession(0.005, 2.5e6, late), QUICK))
    assert estimate.latency_ms == pytest.approx(5.0, rel=1e-6)
    assert estimate.bandwidth_gbps == pytest.approx(0.020, rel=1e-6)


def test_clocks_apart_cancel_in_the_bandwidth_and_latency_falls_back_to_round_trips():
    session = ModelSession(0.005, 2.5e6, lambda: 0.0, offset_s=123.4)  # another machine's clock
    estimate = asyncio.run(ameasure_session(session, QUICK))
    assert estimate.latency_ms == pytest.approx(5.0, rel=1e-6)  # min RTT / 2
    assert estimate.bandwidth_gbps == pytest.approx(0.020, rel=1e-6)
    old_peer = ModelSession(0.005, 2.5e6, lambda: 0.0, reports=False)  # round trips only
    assert asyncio.run(ameasure_session(old_peer, QUICK)).bandwidth_gbps == pytest.approx(0.020, rel=1e-6)


def test_samples_that_never_agree_give_a_flagged_best_guess():
    rng = random.Random(5)
    session = ModelSession(0.005, 2.5e6, lambda: rng.uniform(0.03, 0.1))  # every sample late
    estimate = asyncio.run(ameasure_session(session, QUICK))
    assert not estimate.agreed
    assert sum(1 for n in session.sizes if n == session.sizes[-2]) == QUICK.max_transfers


def test_a_measurement_asked_to_stop_ends_after_the_round_trip_in_progress():
    session = ModelSession(0.005, 2.5e6, lambda: 0.0)
    estimate = asyncio.run(ameasure_session(session, QUICK, stop=lambda: len(session.sizes) >= 12))
    assert estimate is None and len(session.sizes) == 12  # the prober paused: no result, no further probes


def test_link_table_smooths_latency_and_transfer_time():
    table = LinkTable(weight=0.5)
    assert table.update("p", LinkEstimate(10.0, 1.0, 5)) == LinkEstimate(10.0, 1.0, 5)
    smoothed = table.update("p", LinkEstimate(20.0, 0.5, 5))
    assert smoothed.latency_ms == pytest.approx(15.0)
    assert smoothed.bandwidth_gbps == pytest.approx(1 / (0.5 / 1.0 + 0.5 / 0.5))  # averaged as seconds per bit
    assert smoothed.samples == 10 and table.get("p") == smoothed
    table.forget("p")
    assert table.get("p") is None and table.snapshot() == {}


def test_link_table_keeps_a_disagreeing_measurement_out_of_an_agreed_average():
    table = LinkTable(weight=0.5)
    guess = LinkEstimate(12.0, 0.5, 20, agreed=False)
    assert table.update("p", guess) == guess  # nothing better yet
    good = LinkEstimate(10.0, 1.0, 10)
    assert table.update("p", good) == good  # replaces the guess, not averaged with it
    assert table.update("p", LinkEstimate(30.0, 0.1, 20, agreed=False)) == good
    assert table.update("p", LinkEstimate(20.0, 0.5, 10)).latency_ms == pytest.approx(15.0)


def test_bad_probe_configs_are_refused():
    for kwargs in [dict(pings=0), dict(transfers=1), dict(max_transfers=2), dict(agreement=0.0),
                   dict(first_transfer_bytes=0), dict(min_transfer_s=3.0, max_transfer_s=2.0)]:
        with pytest.raises(ValueError):
            ProbeConfig(**kwargs)
    with pytest.raises(ValueError):
        LinkTable(weight=0.0)


def test_a_transfer_lost_in_the_timers_noise_grows_the_next_a_bounded_step():
    # the first transfer times as fast as a ping (a loaded machine's noise): its "rate" is unbounded, and the next
    # transfer once grew to 64 MiB, 100 s of this 5 Mbit/s link; it grows at most MAX_GROWTH times a step
    session = ModelSession(0.005, 0.625e6, lambda: 0.0)
    timed = session.roundtrip

    async def first_transfer_unseen(request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None):
        trip = await timed(request_bytes, reply_bytes, timeout_s)
        if request_bytes and session.sizes.count(request_bytes) == 1 and len(set(session.sizes)) == 2:
            return RoundTrip(0.010, 0.005, same_clock=True)  # timed as a ping
        return trip

    session.roundtrip = first_transfer_unseen
    estimate = asyncio.run(ameasure_session(session, QUICK))
    transfers = [n for n in session.sizes if n > 0]
    assert transfers[1] == MAX_GROWTH * transfers[0]
    assert estimate.bandwidth_gbps == pytest.approx(0.005, rel=1e-6)
