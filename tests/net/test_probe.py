"""The link prober measures emulated links through the transport; smoothing; a deadline on a silent peer."""

from __future__ import annotations

import time

import pytest

from p2ptrain.errors import PeerTimeoutError
from p2ptrain.net.probe import LinkEstimate, LinkTable, ProbeConfig, measure_link
from p2ptrain.net.transport import TransportConfig

# Sized so that a measurement takes a second or two: transfers of n/β ≥ max(3 RTT, 0.15 s), the fastest of 3.
QUICK = ProbeConfig(pings=10, transfers=3, rtt_multiple=3.0, min_transfer_s=0.15, deadline_s=30.0)
CONFIG = TransportConfig(call_timeout_s=5.0)


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("latency_ms, bandwidth_mbit", [(50.0, 20.0), (5.0, 200.0)])
def test_measured_latency_and_bandwidth_match_the_emulated_link(make_transport, latency_ms, bandwidth_mbit):
    a = make_transport(CONFIG)
    b = make_transport(CONFIG, join=a)
    for sender, receiver in ((a, b), (b, a)):  # both directions: pings and replies cross both links
        sender.emulator.set_link(str(receiver.peer_id), latency_ms / 1e3, bandwidth_mbit * 1e6 / 8)
    estimate = measure_link(b, a.peer_id, QUICK)
    assert estimate.latency_ms == pytest.approx(latency_ms, rel=0.10)
    assert estimate.bandwidth_gbps == pytest.approx(bandwidth_mbit / 1e3, rel=0.10)
    assert estimate.samples >= QUICK.pings + QUICK.transfers


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


def test_link_table_smooths_latency_and_transfer_time():
    table = LinkTable(weight=0.5)
    assert table.update("p", LinkEstimate(10.0, 1.0, 5)) == LinkEstimate(10.0, 1.0, 5)
    smoothed = table.update("p", LinkEstimate(20.0, 0.5, 5))
    assert smoothed.latency_ms == pytest.approx(15.0)
    assert smoothed.bandwidth_gbps == pytest.approx(1 / (0.5 / 1.0 + 0.5 / 0.5))  # averaged as seconds per bit
    assert smoothed.samples == 10 and table.get("p") == smoothed
    table.forget("p")
    assert table.get("p") is None and table.snapshot() == {}


def test_bad_probe_configs_are_refused():
    for kwargs in [dict(pings=0), dict(first_transfer_bytes=0), dict(min_transfer_s=3.0, max_transfer_s=2.0)]:
        with pytest.raises(ValueError):
            ProbeConfig(**kwargs)
    with pytest.raises(ValueError):
        LinkTable(weight=0.0)
