"""Which link measurements run through a peer at once (``probe_gate``): the gate's rules, a probe stream refused
``busy`` by the peer it would measure while that peer measures it, and two probers of one peer whose downlink
their probes share, started at once: each measures the downlink, where probes served at once would each have
measured a share of it."""

from __future__ import annotations

import queue
import random
import threading
import time
from types import SimpleNamespace

import pytest

from p2ptrain.agent.config import LinksConfig
from p2ptrain.agent.links import LinkProber
from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.emulation import LinkEmulator
from p2ptrain.net.transport.endpoint import TransportConfig
from p2ptrain.net.transport.messages import Refusal
from p2ptrain.net.transport.probe import LinkEstimate, ProbeConfig, measure_link
from p2ptrain.net.transport.probe_gate import EVERY_PEER, ProbeGate

QUICK = ProbeConfig(pings=6, transfers=3, rtt_multiple=3.0, min_transfer_s=0.4, max_transfer_s=1.0, deadline_s=30.0)
CONFIG = TransportConfig(call_timeout_s=5.0)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_serves_one_probe_at_a_time_and_none_from_the_peer_it_measures():
    gate = ProbeGate()
    token = gate.try_serve("b")
    assert token is not None and gate.busy and gate.serves("b") and not gate.serves("c")
    assert gate.try_serve("c") is None  # a second probe while one is served: our downlink would carry both
    assert gate.acquire("c", 0.05)  # but we may measure a third peer meanwhile
    assert gate.try_serve("c") is None  # ... and serve nothing from it
    gate.release()
    assert not gate.acquire("b", 0.05)  # our measurement of b waits for b's probe of us
    waited: queue.Queue = queue.Queue()
    waiter = threading.Thread(target=lambda: waited.put(gate.acquire("b", 10.0)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not gate._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.served(token)
    assert gate.try_serve("b") is None  # b's probe ended, but ours waited for it: its turn, not b's next probe
    assert waited.get(timeout=10) is True
    waiter.join(10)
    assert gate.try_serve("b") is None  # we measure b: b's probe of us would share the line both ways
    token = gate.try_serve("c")
    assert token is not None  # another peer's probe while we measure b: served
    gate.served(token)
    gate.release()
    assert not gate.busy


def test_measuring_our_line_takes_the_whole_gate():
    gate = ProbeGate()
    token = gate.try_serve("b")
    assert not gate.acquire(EVERY_PEER, 0.05)  # our line's flows wait for any probe we serve
    gate.served(token)
    assert gate.acquire(EVERY_PEER, 1.0)
    assert gate.try_serve("b") is None and gate.try_serve("c") is None
    gate.release()
    assert gate.try_serve("c") is not None


def test_a_probe_stream_served_past_its_deadline_no_longer_holds_the_gate():
    clock = Clock()
    gate = ProbeGate(max_serve_s=60.0, clock=clock)
    assert gate.try_serve("b") is not None  # a peer that opens a probe stream and never ends it
    assert gate.try_serve("c") is None and not gate.acquire("b", 0.0)
    clock.now += 61.0
    assert not gate.serves("b") and gate.acquire("b", 0.0)  # a minute later our own measurement goes ahead
    gate.release()
    assert gate.try_serve("c") is not None


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_peer_that_measures_the_prober_refuses_its_probe_busy_and_serves_it_once_done(make_transport):
    a = make_transport(CONFIG)
    b = make_transport(CONFIG, join=a)
    assert a.probe_gate.acquire(str(b.peer_id), 1.0)  # a measures b
    with pytest.raises(MessageRejected) as refused:
        measure_link(b, a.peer_id, QUICK)
    assert refused.value.code == Refusal.BUSY, refused.value
    a.probe_gate.release()
    assert measure_link(b, a.peer_id, QUICK).bandwidth_gbps > 0
    deadline = time.monotonic() + 20  # the replier lets the gate go when it sees the stream end
    while a.probe_gate.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not a.probe_gate.busy and not b.probe_gate.busy


class Board:
    def __init__(self):
        self.rows: queue.Queue = queue.Queue()

    def publish_links(self, record) -> bool:
        return True


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_probers_of_one_peer_started_at_once_each_measure_its_downlink(make_transport, monkeypatch):
    """The target's emulated downlink (8 Mbit/s) is what both probers' transfers cross; their uplinks are
    faster. Served at once, each would see about half of it; refused ``busy`` while the other measures, the
    second measures after the first, the whole downlink."""
    # these transports' peer IDs are Ed25519 keys, which a links record does not take: keep the rows as they are
    monkeypatch.setattr("p2ptrain.agent.links.LinksRecord", SimpleNamespace(from_peers=lambda row, *_: row))
    downlink_mbit = 8.0
    target = make_transport(CONFIG, emulator=LinkEmulator())
    target.emulator.set_access(downlink_bytes_per_s=downlink_mbit * 1e6 / 8)
    probers = [make_transport(CONFIG, join=target, emulator=LinkEmulator()) for _ in range(2)]
    for prober in probers:  # fast uplinks, so the target's downlink is the path's bottleneck
        prober.emulator.set_link(str(target.peer_id), 0.005, 100e6 / 8)
        target.emulator.set_link(str(prober.peer_id), 0.005, 100e6 / 8)
    config = LinksConfig(min_rounds=1, round_pause_s=0.05, measure_access=False, probe=QUICK)
    rows: list[queue.Queue] = [queue.Queue() for _ in probers]
    link_probers = [LinkProber(p, Board(), config, on_publish=r.put, rng=random.Random(i))
                    for i, (p, r) in enumerate(zip(probers, rows, strict=True))]
    try:
        for link_prober in link_probers:
            link_prober.start()
        for link_prober in link_probers:  # both at once
            link_prober.set_peers([str(target.peer_id)])
        measured = [_first_with(r, str(target.peer_id)).bandwidth_gbps * 1e3 for r in rows]
    finally:
        for link_prober in link_probers:
            link_prober.stop(timeout_s=10)
    for mbit in measured:
        assert abs(mbit - downlink_mbit) <= 0.15 * downlink_mbit, measured


def _first_with(rows: queue.Queue, peer: str, timeout_s: float = 60.0):
    """The first row published that has ``peer``'s link (a round refused ``busy`` publishes none of it)."""
    deadline = time.monotonic() + timeout_s
    while peer not in (row := rows.get(timeout=max(deadline - time.monotonic(), 0.01))):
        pass
    return row[peer]


def test_the_prober_leaves_a_peer_that_measures_it_for_after_the_others(monkeypatch):
    """Rather than wait for a peer's probe of us to end (a whole measurement), the prober measures its other
    peers first, and that one once its probe ended."""
    measured: list[str] = []

    def measure(transport, peer, config, stop):
        measured.append(peer)
        return LinkEstimate(10.0, 1.0, 20)

    monkeypatch.setattr("p2ptrain.agent.links.measure_link", measure)
    prober = LinkProber(None, Board(), LinksConfig(min_rounds=1, round_pause_s=0.05, measure_access=False),
                        rng=random.Random(0))
    token = prober._gate.try_serve("x")  # x measures us
    prober.start()
    try:
        prober.set_peers(["x", "y"])
        deadline = time.monotonic() + 10
        while not measured and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a round's pause or two: x is still measuring us, so it is left alone
        assert measured == ["y"]
        prober._gate.served(token)
        while len(measured) < 2 and time.monotonic() < deadline + 10:
            time.sleep(0.01)
        assert measured == ["y", "x"]
    finally:
        prober.stop(timeout_s=10)
