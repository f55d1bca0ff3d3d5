"""The link emulator: FIFO bookkeeping on a fake clock, the scaling helper, and real shaped transfers (judged by
the arrival times the transport computed and honoured, not by the wall clock)."""

from __future__ import annotations

import time

import pytest
import torch
from net_recorders import RecordingEmulator, RecordingPacer

from p2ptrain.net.transport.emulation import EmulationConfig, LinkEmulator, LinkProfile, scaled_link
from p2ptrain.net.transport.messages import MessageKind, Tag
from p2ptrain.net.transport.pacing import TAIL_LEAD_S

ALPHA_S = 0.05
BETA_BYTES_PER_S = 20e6 / 8  # 20 Mbit/s
MB = 1_000_000
RUN = "nettest"  # the run of make_transport's transports


class FakeClock:
    def __init__(self, now_s: float = 100.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def test_one_message_arrives_after_serialisation_and_latency():
    emulator = LinkEmulator(FakeClock(100.0))
    emulator.set_link("b", ALPHA_S, BETA_BYTES_PER_S)
    slot = emulator.reserve("b", MB)
    assert slot.start_s == 100.0
    assert slot.free_s == pytest.approx(100.4)
    assert slot.arrive_s == pytest.approx(100.45)
    assert slot.release_s(MB // 2) == pytest.approx(100.25)  # byte e arrives at start + e/β + α


def test_bandwidth_serialises_and_latency_overlaps():
    clock = FakeClock(0.0)
    emulator = LinkEmulator(clock)
    emulator.set_link("b", ALPHA_S, BETA_BYTES_PER_S)
    first, second = emulator.reserve("b", MB), emulator.reserve("b", MB)
    assert second.start_s == pytest.approx(first.free_s)  # waits for the link, not for the first's arrival
    assert second.arrive_s - first.arrive_s == pytest.approx(MB / BETA_BYTES_PER_S)
    clock.now_s = 5.0  # long after: the link is free again
    assert emulator.reserve("b", 0).arrive_s == pytest.approx(5.0 + ALPHA_S)


def test_links_are_per_destination_and_unknown_ones_are_unshaped():
    emulator = LinkEmulator(FakeClock(0.0))
    assert not emulator.enabled and emulator.reserve("b", MB) is None
    emulator.set_link("b", ALPHA_S, BETA_BYTES_PER_S)
    emulator.set_link("c", 0.005, 10 * BETA_BYTES_PER_S)
    emulator.reserve("b", 10 * MB)  # a busy link to b does not delay c
    assert emulator.reserve("c", MB).arrive_s == pytest.approx(0.005 + 0.04)
    assert emulator.reserve("d", MB) is None
    emulator.clear_link("b")
    assert emulator.reserve("b", MB) is None and emulator.enabled


def test_a_link_can_change_at_any_time():
    emulator = LinkEmulator(FakeClock(0.0))
    emulator.set_link("b", ALPHA_S, BETA_BYTES_PER_S)
    emulator.reserve("b", MB)
    emulator.set_link("b", 0.0, 2 * BETA_BYTES_PER_S)  # faster from now on; the queue stays
    slot = emulator.reserve("b", MB)
    assert slot.start_s == pytest.approx(0.4) and slot.arrive_s == pytest.approx(0.6)


def test_bad_profiles_are_refused():
    for latency_s, bandwidth in [(-1.0, 1.0), (float("nan"), 1.0), (0.0, 0.0), (0.0, float("inf"))]:
        with pytest.raises(ValueError):
            LinkProfile(latency_s, bandwidth)
    with pytest.raises(ValueError):
        LinkEmulator().reserve("b", -1)
    with pytest.raises(ValueError):
        EmulationConfig(time_scale=0.0)


def test_scaling_follows_design():
    # α' = α × time_scale, β' = β × size_factor / time_scale
    link = scaled_link(67.0, 0.79, EmulationConfig(time_scale=0.1, size_factor=0.01))
    assert link.latency_s == pytest.approx(0.0067)
    assert link.bandwidth_bytes_per_s == pytest.approx(0.79e9 / 8 * 0.01 / 0.1)
    assert scaled_link(50.0, 0.02) == LinkProfile(0.05, BETA_BYTES_PER_S)


def test_links_from_cluster_matrices_use_the_senders_row():
    emulator = LinkEmulator(FakeClock(0.0))
    latency_ms = [[0, 10.0, 20.0], [11.0, 0, 30.0], [21.0, 31.0, 0]]
    bandwidth_gbps = [[100, 1.0, 2.0], [1.5, 100, 3.0], [2.5, 3.5, 100]]
    emulator.set_links_from_matrices(["p0", "p1", "p2"], 1, latency_ms, bandwidth_gbps)
    assert emulator.link("p0") == scaled_link(11.0, 1.5)
    assert emulator.link("p2") == scaled_link(30.0, 3.0)
    assert emulator.link("p1") is None
    with pytest.raises(ValueError):
        emulator.set_links_from_matrices(["p0", "p1"], 0, latency_ms, bandwidth_gbps)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_shaped_messages_carry_the_models_arrival_and_are_held_until_it(make_transport, monkeypatch):
    """1 MB over 50 ms / 20 Mbit/s through real transports. Asserted on the times the emulator computed and the
    stamps the receiver honoured, not on how long the machine took: a message is due α + n/β after its slot
    starts, the sender lets its pieces go as the link would deliver them, the receiver holds it until its
    stamp. Two sent together share the link: the second starts when the first has left the link (bandwidth
    serialises), before the first arrives (latency overlaps), and is due one n/β after it."""
    monkeypatch.setattr("p2ptrain.net.transport.endpoint.Pacer", RecordingPacer)
    receiver = make_transport()
    sender = make_transport(join=receiver, emulator=RecordingEmulator())
    sender.send(receiver.peer_id, Tag(RUN, 0, 0, "warmup"), torch.zeros(1))  # connection and streams set up
    receiver.recv(Tag(RUN, 0, 0, "warmup"), sender.peer_id, (1,), torch.float32)
    sender.emulator.set_link(str(receiver.peer_id), ALPHA_S, BETA_BYTES_PER_S)
    message = torch.zeros(MB // 4)
    serial_s = MB / BETA_BYTES_PER_S

    sender.pacer.waits.clear()
    sent_s = time.monotonic()
    sending = sender.send_async(receiver.peer_id, Tag(RUN, 0, 0, MessageKind.ACTIVATION), message)
    receiver.recv(Tag(RUN, 0, 0, MessageKind.ACTIVATION), sender.peer_id, message.shape, message.dtype)
    got_s = time.monotonic()
    sending.result(timeout=10)
    (alone,) = sender.emulator.to(receiver.peer_id)
    slot = alone.slot
    assert alone.size_bytes == MB and slot.start_s >= sent_s
    assert slot.arrive_s - slot.start_s == pytest.approx(ALPHA_S + serial_s, rel=1e-9)
    # the sender's pieces leave as their bytes would reach the receiver, from start + α (the first byte) to
    # the arrival (the last bytes, TAIL_LEAD_S early: the receiver holds them until the stamp)
    waits = sender.pacer.waits
    assert waits == sorted(waits) and len(waits) >= 2
    assert waits[0] == pytest.approx(slot.start_s + ALPHA_S, abs=1e-9)
    assert waits[-1] == pytest.approx(slot.arrive_s - TAIL_LEAD_S, abs=1e-9)
    # the stamp crossed the wire as computed, and the message was held until it: never delivered early
    held = receiver.pacer.holds[-1]
    assert held.stamp_s == slot.arrive_s and held.returned_s >= slot.arrive_s and got_s >= slot.arrive_s

    tags = [Tag(RUN, 0, 0, MessageKind.ACTIVATION, micro_batch=i) for i in (1, 2)]
    sendings = [sender.send_async(receiver.peer_id, tag, message) for tag in tags]
    got_s = []
    for tag in tags:
        receiver.recv(tag, sender.peer_id, message.shape, message.dtype)
        got_s.append(time.monotonic())
    for sending in sendings:
        sending.result(timeout=10)
    first, second = (b.slot for b in sender.emulator.to(receiver.peer_id)[1:])
    assert first.start_s >= slot.arrive_s  # booked after the lone message was in
    assert second.start_s == first.free_s  # waits for the link, not for the first's arrival
    assert second.start_s < first.arrive_s  # so its serialisation overlaps the first's latency
    assert second.arrive_s - first.arrive_s == pytest.approx(serial_s, rel=1e-9)
    assert [h.stamp_s for h in receiver.pacer.holds[-2:]] == [first.arrive_s, second.arrive_s]
    assert all(h.returned_s >= h.stamp_s for h in receiver.pacer.holds[-2:])
    assert got_s[0] >= first.arrive_s and got_s[1] >= second.arrive_s
