"""Measuring a peer's own line (net.transport.access_probe): the estimator on rates, pulls in pieces, and the
whole measurement through real transports whose links and lines are emulated. The only timing asserted is
the measured capacity against the emulated one, which the emulator enforces however busy the machine."""

from __future__ import annotations

import pytest

from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.access_probe import (
    AccessConfig,
    Direction,
    estimate_access,
    measure_access,
    per_flow_limit,
    understated_singles,
)
from p2ptrain.net.transport.endpoint import Transport, TransportConfig

CONFIG = AccessConfig()
MBIT = 1e6 / 8  # bytes/s in a Mbit/s


def flows(rates: list[float], flow_s: float = 0.5) -> list[int]:
    """Each flow's bytes when it takes ``flow_s`` alone."""
    return [int(r * flow_s) for r in rates]


def together(count: int, *tries_s: float) -> list[list[float]]:
    """Tries of ``count`` flows at once that all took as long (each try's seconds)."""
    return [[d] * count for d in tries_s]


def test_flows_sharing_our_uplink_give_its_capacity():
    # four paths each limited by our 16 Mbit/s uplink when alone; at once they share it: 4 × 0.5 s
    singles = [16 * MBIT] * 4
    estimate = estimate_access(singles, flows(singles), together(4, 2.1, 1.99), CONFIG)
    assert estimate.capacity_bytes_per_s == pytest.approx(4 * 0.5 * 16 * MBIT / 1.99, rel=1e-6)
    assert estimate.gbps == pytest.approx(0.016 * 2 / 1.99, rel=1e-6)


def test_paths_slower_than_the_line_but_together_faster_give_the_line():
    # 10 Mbit/s paths, a 16 Mbit/s line: the aggregate is the line, above any one path
    singles = [10 * MBIT] * 4
    line = estimate_access(singles, flows(singles), together(4, sum(flows(singles)) / (14 * MBIT)), CONFIG)
    assert line.capacity_bytes_per_s == pytest.approx(14 * MBIT)
    # a FIFO line that one flow left early carried a bit less than a path alone: the line did carry that path
    two = [10 * MBIT] * 2
    assert estimate_access(two, flows(two), together(2, sum(flows(two)) / (9 * MBIT)), CONFIG).capacity_bytes_per_s == (
        pytest.approx(10 * MBIT))


def test_without_a_shared_bottleneck_or_enough_peers_the_line_is_unknown():
    singles = [10 * MBIT] * 4
    no_bottleneck = estimate_access(singles, flows(singles), together(4, 0.55), CONFIG)  # 91 % of their rates alone
    assert no_bottleneck.capacity_bytes_per_s is None and "no shared bottleneck" in no_bottleneck.reason
    assert not no_bottleneck.disturbed  # what the measurement found: measured again at refresh_s, not sooner
    one_peer = estimate_access([16 * MBIT], flows([16 * MBIT]), together(1, 0.5), CONFIG)  # one flow cannot tell line from path
    assert one_peer.capacity_bytes_per_s is None and one_peer.gbps is None
    assert estimate_access(singles, flows(singles), [], CONFIG).capacity_bytes_per_s is None
    disturbed = estimate_access([16 * MBIT] * 4, flows([16 * MBIT] * 4), together(4, 6.0, 7.0), CONFIG)  # slower than one path
    assert disturbed.capacity_bytes_per_s is None and "disturbed" in disturbed.reason and disturbed.disturbed


def test_flows_cut_short_by_the_budget_are_judged_by_when_the_slowest_alone_would_end():
    # a 925 Mbit/s path whose flow the budget cut to 0.29 s, and an 11 Mbit/s one of 0.5 s: at once they end
    # with the slow one, as alone; comparing with the sum of the rates would have made that a 50 % share
    singles, sizes = [925 * MBIT, 11 * MBIT], [32 << 20, int(11 * MBIT * 0.5)]
    assert estimate_access(singles, sizes, [[0.29, 0.52]], CONFIG).capacity_bytes_per_s is None


def test_one_flow_slowed_for_a_moment_is_no_shared_line():
    # three 10 Mbit/s paths into a 100 Mbit/s downlink: at once each carries what it does alone, but a busy CPU
    # held one flow back in both tries, so the longest of them, D, says 68 % of their rates alone (a CI run,
    # where the line was reported at 20 Mbit/s); each flow's own pace says it was one flow, not the line
    singles = [10 * MBIT] * 3
    slowed = estimate_access(singles, flows(singles), [[0.5, 0.51, 0.735], [0.74, 0.5, 0.5]], CONFIG)
    assert slowed.capacity_bytes_per_s is None and slowed.disturbed, slowed.reason  # measured again soon
    # a line they do share slows every flow alike: still found, however one try went
    line = estimate_access(singles, flows(singles), [[1.0, 1.02, 1.05], [0.98, 1.1, 1.0]], CONFIG)
    assert line.capacity_bytes_per_s == pytest.approx(sum(flows(singles)) / 1.05)


def test_two_flows_a_line_serves_in_turn_are_a_shared_line():
    # a home's 11 Mbit/s uplink to two peers (a CI run): at once the line served one flow at its own pace and the
    # other after it, 72 % of their paces on the mean; two flows cannot tell that from one held back, so their
    # aggregate, half of their rates alone, decides
    singles = [11.4 * MBIT, 11.2 * MBIT]
    sizes = flows(singles)
    line = estimate_access(singles, sizes, [[0.53, 1.01], [0.6, 1.02]], CONFIG)
    assert line.capacity_bytes_per_s == pytest.approx(11.4 * MBIT), line.reason
    # from three flows on, one held back is told apart (``test_one_flow_slowed_for_a_moment_is_no_shared_line``),
    # while three a line serves in turn (0.5, 1.0 and 1.5 s: 61 % on the mean) are still a shared line
    three = [10 * MBIT] * 3
    assert estimate_access(three, flows(three), [[0.5, 1.0, 1.5]], CONFIG).capacity_bytes_per_s == (
        pytest.approx(sum(flows(three)) / 1.5))
    assert per_flow_limit(2, 0.7) == 1.0 and per_flow_limit(3, 0.7) == pytest.approx((11 / 18 + 2 / 3) / 2)


def test_a_path_whose_flow_went_faster_at_once_than_alone_is_measured_again():
    # a home's uplink (23 Mbit/s) to two peers: one single was held back to 7.8 Mbit/s (a CI run: its small flow
    # then hid the shared line, 75 % of the rates alone); at once that flow ran at the line's half, 11.5
    singles = [22.7 * MBIT, 7.8 * MBIT]
    sizes = flows(singles)
    assert understated_singles(singles, sizes, [[0.67, sizes[1] / (11.5 * MBIT)]]) == [1]
    assert understated_singles(singles, sizes, together(2, 0.5)) == []  # as fast as alone: nothing to redo
    assert understated_singles(singles, sizes, together(2, 1.0)) == []  # slower at once: what a line does


def test_bad_access_configs_are_refused():
    for bad in ({"min_peers": 1}, {"max_peers": 1}, {"tries": 0}, {"flow_s": 3.0}, {"shared_share": 1.0},
                {"max_transfer_bytes": 1 << 30}, {"first_transfer_bytes": 0}, {"deadline_s": 0.0}):
        with pytest.raises(ValueError):
            AccessConfig(**bad)


def shape_all(transports: list[Transport], latency_ms: float, bandwidth_mbit: float) -> None:
    for a in transports:
        for b in transports:
            if a is not b:
                a.emulator.set_link(str(b.peer_id), latency_ms / 1e3, bandwidth_mbit * MBIT)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_pull_comes_in_pieces_through_the_emulated_links_and_a_peer_may_refuse_it(make_transport):
    a = make_transport(TransportConfig(call_timeout_s=10.0))
    b = make_transport(TransportConfig(call_timeout_s=10.0), join=a)
    small = make_transport(TransportConfig(call_timeout_s=10.0, max_probe_reply_bytes=64 << 10), join=a)
    shape_all([a, b, small], 2.0, 200.0)
    size = (3 << 20) + 5  # three full pieces and a tail

    async def pull(peer, reply_bytes):
        async with a.open_probe(peer) as session:
            return await session.roundtrip(0, reply_bytes)

    trip = a.run_coroutine(pull(b.peer_id, size), 30)
    assert trip.rtt_s >= size / (200 * MBIT) + 2 * 2e-3  # its bytes crossed the emulated link back
    assert b.emulator.link(str(a.peer_id)) is not None
    with pytest.raises(MessageRejected):
        a.run_coroutine(pull(small.peer_id, 1 << 20), 30)
    # in a measurement, the direction a peer refuses is unknown, with the reason; the other is measured
    quick = AccessConfig(flow_s=0.2, tries=1, pings=2, deadline_s=30.0)
    found = measure_access(a, {str(b.peer_id): 200 * MBIT, str(small.peer_id): 200 * MBIT}, quick)
    assert found[Direction.DOWN].capacity_bytes_per_s is None and "failed" in found[Direction.DOWN].reason, found
    assert "failed" not in found[Direction.UP].reason, found


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_home_line_is_measured_through_the_emulator_and_a_peer_without_one_publishes_nothing(make_transport):
    """Four peers, every path 5 ms and 100 Mbit/s; ``home`` has a 16 Mbit/s uplink and a 40 Mbit/s downlink
    shared by its flows. Its line is measured within 25 %; a peer without a line of its own finds none."""
    config = TransportConfig(call_timeout_s=20.0)
    home = make_transport(config)
    others = [make_transport(config, join=home) for _ in range(3)]
    shape_all([home, *others], 5.0, 100.0)
    up_mbit, down_mbit = 16.0, 40.0
    home.emulator.set_access(up_mbit * MBIT, down_mbit * MBIT)
    # what the pair probes would have said: each of home's paths alone, limited by its uplink
    found = measure_access(home, {str(o.peer_id): up_mbit * MBIT for o in others})
    assert found is not None
    up, down = found[Direction.UP], found[Direction.DOWN]
    assert up.capacity_bytes_per_s == pytest.approx(up_mbit * MBIT, rel=0.25), up
    assert down.capacity_bytes_per_s == pytest.approx(down_mbit * MBIT, rel=0.25), down
    print(f"measured uplink {up.gbps * 1e3:.2f} Mbit/s (emulated {up_mbit}), downlink {down.gbps * 1e3:.2f} Mbit/s "
          f"(emulated {down_mbit})")
    plain = others[0]
    paths = {str(home.peer_id): up_mbit * MBIT, **{str(o.peer_id): 100 * MBIT for o in others[1:]}}
    found = measure_access(plain, paths)
    assert found is not None
    assert found[Direction.UP].capacity_bytes_per_s is None, found
    assert found[Direction.DOWN].capacity_bytes_per_s is None, found


def test_a_peer_may_pull_only_its_budget_of_reply_bytes_per_window():
    """A pull asks for up to ``max_probe_reply_bytes`` with a request of a few bytes: each sender gets a budget
    per window, so no member can turn us into an amplifier; pair probes' small replies are never counted."""
    from p2ptrain.net.transport.servicer import PullBudget

    now = [0.0]
    budget = PullBudget(100_000, 60.0, lambda: now[0])
    assert budget.take("a", 60_000) is None and budget.take("b", 60_000) is None  # each sender its own
    assert "exceed the 100000 a peer may pull" in budget.take("a", 60_000)
    assert budget.take("a", 40_000) is None and budget.take("a", 100) is None  # small replies: not counted
    now[0] = 60.0
    assert budget.take("a", 100_000) is None  # a new window
