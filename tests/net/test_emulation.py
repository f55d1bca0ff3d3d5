"""The link emulator: FIFO bookkeeping on a fake clock, the scaling helper, and real shaped transfers."""

from __future__ import annotations

import time

import pytest
import torch

from p2ptrain.net.transport.emulation import EmulationConfig, LinkEmulator, LinkProfile, scaled_link
from p2ptrain.net.transport.messages import ACTIVATION, Tag

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
def test_shaped_messages_arrive_as_the_model_says(make_transport):
    """1 MB over 50 ms / 20 Mbit/s arrives after α + n/β (within 5%); two sent together share the link,
    so the second arrives one serialisation (n/β) after the first."""
    receiver = make_transport()
    sender = make_transport(join=receiver)
    sender.send(receiver.peer_id, Tag(RUN, 0, 0, "warmup"), torch.zeros(1))  # connection and streams set up
    receiver.recv(Tag(RUN, 0, 0, "warmup"), sender.peer_id, (1,), torch.float32)
    sender.emulator.set_link(str(receiver.peer_id), ALPHA_S, BETA_BYTES_PER_S)
    message = torch.zeros(MB // 4)
    expected_s = ALPHA_S + MB / BETA_BYTES_PER_S

    start_s = time.perf_counter()
    sending = sender.send_async(receiver.peer_id, Tag(RUN, 0, 0, ACTIVATION), message)
    receiver.recv(Tag(RUN, 0, 0, ACTIVATION), sender.peer_id, message.shape, message.dtype)
    alone_s = time.perf_counter() - start_s
    sending.result(timeout=10)
    assert alone_s == pytest.approx(expected_s, rel=0.05)

    tags = [Tag(RUN, 0, 0, ACTIVATION, micro_batch=i) for i in (1, 2)]
    start_s = time.perf_counter()
    sendings = [sender.send_async(receiver.peer_id, tag, message) for tag in tags]
    arrivals_s = []
    for tag in tags:
        receiver.recv(tag, sender.peer_id, message.shape, message.dtype)
        arrivals_s.append(time.perf_counter() - start_s)
    for sending in sendings:
        sending.result(timeout=10)
    assert arrivals_s[0] == pytest.approx(expected_s, rel=0.05)
    assert arrivals_s[1] == pytest.approx(expected_s + MB / BETA_BYTES_PER_S, rel=0.05)
