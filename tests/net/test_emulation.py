"""The link emulator: FIFO bookkeeping on a fake clock, the scaling helper, and real shaped transfers (judged by
the arrival times the transport computed and honoured, not by the wall clock)."""

from __future__ import annotations

import time

import pytest
import torch
from net_recorders import RecordingEmulator, RecordingPacer

from p2ptrain.net.transport.emulation import (
    Downlink,
    EmulationConfig,
    LinkEmulator,
    LinkProfile,
    scaled_bandwidth,
    scaled_link,
)
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


def delivered_s(slot, downlink: Downlink, clock: FakeClock) -> float:
    """The receiver's side of the model for a message booked as ``slot`` on the sender: its first bytes come
    in at s + α, when it books the downlink; delivered at f = max(d + n/D, e_end)."""
    clock.now_s = slot.start_s + slot.link.latency_s
    through_s = downlink.reserve(round((slot.free_s - slot.start_s) * slot.link.bandwidth_bytes_per_s))
    return slot.arrive_s if through_s is None else max(through_s, slot.arrive_s)


def test_two_flows_out_of_one_uplink_take_the_uplinks_total_time():
    """U = 10 MB/s below both pair links (β = 20 MB/s): a message to b and one to c, ready together, queue on
    the uplink (FIFO, one tc queue): the first is in n/U after it starts, the second n/U later; each flows
    at min(β, U) = U, so byte e of the second arrives at n/U + e/U + α."""
    emulator = LinkEmulator(FakeClock(0.0))
    emulator.set_link("b", 0.01, 20 * MB)
    emulator.set_link("c", 0.02, 20 * MB)
    emulator.set_access(uplink_bytes_per_s=10 * MB)
    to_b, to_c = emulator.reserve("b", 5 * MB), emulator.reserve("c", 5 * MB)
    assert (to_b.start_s, to_b.free_s, to_b.arrive_s) == pytest.approx((0.0, 0.5, 0.51))
    assert (to_c.start_s, to_c.free_s, to_c.arrive_s) == pytest.approx((0.5, 1.0, 1.02))  # 10 MB / U in all
    assert to_c.release_s(MB) == pytest.approx(0.5 + 0.1 + 0.02)
    assert emulator.reserve("d", 2 * MB).arrive_s == pytest.approx(1.2)  # no pair profile: the uplink alone


def test_a_pair_link_slower_than_the_uplink_limits_its_flow_while_the_uplink_carries_others():
    """U = 20 MB/s > β_ab = 5 MB/s: the message to b flows at β (its pair link is the limit) but holds the
    uplink only n/U, so a message to c starts then and flows at min(β_ac, U); the next one to b waits for its
    pair link."""
    emulator = LinkEmulator(FakeClock(0.0))
    emulator.set_link("b", 0.0, 5 * MB)
    emulator.set_link("c", 0.0, 40 * MB)
    emulator.set_access(uplink_bytes_per_s=20 * MB)
    to_b = emulator.reserve("b", 2 * MB)
    assert (to_b.start_s, to_b.arrive_s) == pytest.approx((0.0, 0.4))
    assert to_b.link.bandwidth_bytes_per_s == 5 * MB
    to_c = emulator.reserve("c", 2 * MB)
    assert (to_c.start_s, to_c.arrive_s) == pytest.approx((0.1, 0.2))
    assert to_c.link.bandwidth_bytes_per_s == 20 * MB
    again_b = emulator.reserve("b", 2 * MB)  # behind b's pair link, not the uplink
    assert (again_b.start_s, again_b.arrive_s) == pytest.approx((0.4, 0.8))


def test_two_senders_into_one_downlink_are_delivered_one_after_the_other():
    """Two senders' messages of n = 2 MB reach a receiver with D = 4 MB/s at once (both pair links 10 MB/s,
    α = 0.1 s): d1 = s + α, the first is through at d1 + n/D; the second queues behind it (FIFO); each is
    delivered at max(d + n/D, e_end), here the downlink's time since D < β."""
    clock = FakeClock(0.0)
    senders = [LinkEmulator(clock) for _ in range(2)]
    for sender in senders:
        sender.set_link("r", 0.1, 10 * MB)
    receiver = LinkEmulator(clock)
    receiver.set_access(downlink_bytes_per_s=4 * MB)
    slots = [sender.reserve("r", 2 * MB) for sender in senders]
    assert [slot.arrive_s for slot in slots] == pytest.approx([0.3, 0.3])  # each alone would be in at 0.3 s
    assert [delivered_s(slot, receiver.downlink, clock) for slot in slots] == pytest.approx([0.6, 1.1])
    clock.now_s = 1.0  # a small message from a third sender queues behind what is left (FIFO)
    assert receiver.downlink.reserve(MB // 10) == pytest.approx(1.125)
    clock.now_s = 5.0  # long after: the downlink is free again, and a downlink faster than β changes nothing
    receiver.set_access(downlink_bytes_per_s=40 * MB)
    late = senders[0].reserve("r", 2 * MB)
    assert delivered_s(late, receiver.downlink, clock) == late.arrive_s == pytest.approx(5.3)


def test_without_access_links_the_numbers_are_todays_exactly():
    """No U and no D (never set, or cleared): every slot is the pair link's FIFO bit for bit, start = max(t,
    free), frees = start + n/β, arrives = frees + α, and the downlink books nothing."""
    clock = FakeClock(3.0)
    emulator = LinkEmulator(clock)
    emulator.set_access(uplink_bytes_per_s=MB, downlink_bytes_per_s=MB)
    emulator.reserve("b", 10 * MB)  # queued on the uplink: cleared with it
    emulator.set_access()
    assert not emulator.enabled
    assert emulator.reserve("b", MB) is None and emulator.downlink.reserve(MB) is None
    emulator.set_link("b", ALPHA_S, BETA_BYTES_PER_S)
    emulator.set_link("c", 0.003, 3 * BETA_BYTES_PER_S)
    free_s = {"b": float("-inf"), "c": float("-inf")}
    messages = [(3.0, "b", 123_457), (3.0, "c", MB), (3.01, "b", 7), (3.4, "c", 0), (9.0, "b", MB)]
    for now_s, peer, size in messages:
        clock.now_s = now_s
        link = emulator.link(peer)
        start_s = max(now_s, free_s[peer])
        free_s[peer] = start_s + size / link.bandwidth_bytes_per_s
        slot = emulator.reserve(peer, size)
        assert (slot.start_s, slot.free_s, slot.arrive_s, slot.link) == (
            start_s, free_s[peer], free_s[peer] + link.latency_s, link)
        assert slot.release_s(size // 3) == start_s + size // 3 / link.bandwidth_bytes_per_s + link.latency_s


def test_bad_access_links_are_refused():
    emulator = LinkEmulator(FakeClock(0.0))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            emulator.set_access(uplink_bytes_per_s=bad)
        with pytest.raises(ValueError):
            emulator.set_access(downlink_bytes_per_s=bad)
    with pytest.raises(ValueError):
        emulator.downlink.reserve(-1)
    assert not emulator.enabled


def test_access_links_from_a_cluster_scale_as_bandwidth():
    # U' = U × size_factor / time_scale, as β'; the device's own entries; None or inf: unlimited
    config = EmulationConfig(time_scale=0.1, size_factor=0.01)
    assert scaled_bandwidth(0.79, config) == scaled_link(67.0, 0.79, config).bandwidth_bytes_per_s
    assert scaled_bandwidth(0.02) == BETA_BYTES_PER_S
    emulator = LinkEmulator(FakeClock(0.0))
    latency_ms = [[0, 10.0, 20.0], [11.0, 0, 30.0], [21.0, 31.0, 0]]
    bandwidth_gbps = [[100, 1.0, 2.0], [1.5, 100, 3.0], [2.5, 3.5, 100]]
    emulator.set_links_from_matrices(["p0", "p1", "p2"], 1, latency_ms, bandwidth_gbps, config,
                                     uplink_gbps=[0.1, 0.05, None], downlink_gbps=[0.2, 0.5, 0.3])
    assert emulator.uplink_bytes_per_s == scaled_bandwidth(0.05, config)
    assert emulator.downlink.bandwidth_bytes_per_s == scaled_bandwidth(0.5, config)
    assert emulator.link("p2") == scaled_link(30.0, 3.0, config)
    emulator.set_links_from_matrices(["p0", "p1", "p2"], 2, latency_ms, bandwidth_gbps, config,
                                     uplink_gbps=[0.1, 0.05, None], downlink_gbps=[0.2, 0.5, float("inf")])
    assert emulator.uplink_bytes_per_s is None and emulator.downlink.bandwidth_bytes_per_s is None
    with pytest.raises(ValueError):
        emulator.set_links_from_matrices(["p0", "p1", "p2"], 0, latency_ms, bandwidth_gbps, uplink_gbps=[1.0])


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
