"""Link measurement through the agents: every emulated link is measured, published and planned with, and what
load cannot change holds (no link measures faster than emulated, one ten times slower measures slower, the
leader's plan is the best for the network it measured). How closely a measurement recovers a link is shown
without load, on modelled round trips (tests/net/test_probe.py), and that a plan on links measured within
10 % is as good as on the true ones, in tests/planning/test_measured.py. The prober's publishing rule, on
fake measurements. An agent's own line: measured by its prober through real transports and emulated links
once its pairs are, and what its peer record says of it (declared, emulated, measured)."""

from __future__ import annotations

import dataclasses
import json
import queue
import random
import re
import threading
import time
from types import SimpleNamespace

import base58
import numpy as np
import pytest
from agent_helpers import events, run_swarm

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig, LinksConfig
from p2ptrain.agent.links import LinkProber, line_to_publish
from p2ptrain.agent.shaping import LinkShaping
from p2ptrain.config import config_from_dict
from p2ptrain.errors import MessageRejected
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, peer_tag
from p2ptrain.net.transport.access_probe import AccessConfig, AccessEstimate, Direction
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import Refusal
from p2ptrain.net.transport.probe import LinkEstimate, ProbeConfig
from p2ptrain.planning import Workload, make_objective, scenario, schedule
from p2ptrain.planning.cluster import Cluster
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

FLOAT32_REL = 1e-6  # a links record carries its figures as float32


class Board:
    """The DHT as the prober sees it: keeps the rows it publishes."""

    def __init__(self):
        self.rows: list[LinksRecord] = []

    def publish_links(self, record: LinksRecord) -> bool:
        self.rows.append(record)
        return True


def test_the_prober_publishes_a_peer_once_measured_and_a_disagreeing_one_after_another_try(monkeypatch):
    rng = random.Random(3)
    fast, slow = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(2))
    measured = {fast: [LinkEstimate(10.0, 1.0, 20)],  # agreed at once
                slow: [LinkEstimate(50.0, 0.1, 20, agreed=False), LinkEstimate(55.0, 0.09, 20, agreed=False)]}
    calls: dict[str, int] = {}

    def measure_link(transport, peer, config, stop):
        calls[peer] = calls.get(peer, 0) + 1
        return measured[peer][min(calls[peer], len(measured[peer])) - 1]

    monkeypatch.setattr("p2ptrain.agent.links.measure_link", measure_link)
    rows: queue.Queue = queue.Queue()
    board = Board()
    prober = LinkProber(None, board, LinksConfig(min_rounds=1, round_pause_s=0.05, measure_access=False),
                        on_publish=rows.put, rng=random.Random(0)).start()
    try:
        prober.set_peers([fast, slow])
        row = rows.get(timeout=10)
        if slow not in row:  # the disagreeing one waits a try (a busy publisher may store the newer row alone)
            assert row == {fast: LinkMeasurement(10.0, 1.0)}
            row = rows.get(timeout=10)
        # its second, still disagreeing: a best guess, replacing the first (published after one try: 50 ms)
        assert row[fast].latency_ms == pytest.approx(10.0) and row[fast].bandwidth_gbps == pytest.approx(1.0)
        assert row[slow] == LinkMeasurement(55.0, 0.09)
        time.sleep(0.5)  # ten round pauses: links known well enough are not probed again before refresh_s
        assert calls == {fast: 1, slow: 2}
        prober.config = dataclasses.replace(prober.config, refresh_s=0.2)
        prober.set_peers([fast])  # the round that drops the slow peer from the row wakes the prober
        deadline = time.monotonic() + 10
        while calls[fast] < 3 and time.monotonic() < deadline:  # refreshed every 0.2 s from now on
            time.sleep(0.05)
        assert calls[fast] >= 3 and calls[slow] == 2
    finally:
        prober.stop(timeout_s=10)
    assert board.rows[-1].resolve([fast]) == {fast: LinkMeasurement(10.0, 1.0)}
    # every row a higher version (unix seconds, or one more than the last), each entry since its first row
    versions = [row.version for row in board.rows]
    assert all(a < b for a, b in zip(versions, versions[1:], strict=False)) and versions[0] >= int(time.time()) - 60
    assert dict(board.rows[-1].since) == {peer_tag(fast): versions[0]}
    first_slow = next(row for row in board.rows if slow in row.resolve([fast, slow]))
    assert dict(first_slow.since) == {peer_tag(fast): versions[0], peer_tag(slow): first_slow.version}


def test_a_direction_not_yet_known_that_came_out_disturbed_is_measured_again_soon_then_at_refresh(monkeypatch):
    """A busy moment (or a peer failing the probe) leaves the downlink unknown: measured again after ``retry_s``,
    at most ``retries`` times in a row, then at ``refresh_s``; a direction already known, or one found unknown for
    what the measurement showed (no shared bottleneck), waits for ``refresh_s``."""
    rng = random.Random(5)
    peers = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(2))
    monkeypatch.setattr("p2ptrain.agent.links.measure_link", lambda transport, peer, config, stop: LinkEstimate(5.0, 0.1, 20))
    up = AccessEstimate(2e6, "3 flows at once carried 33% of their rates alone")
    disturbed = AccessEstimate(None, "disturbed: the flows at once carried 30% of the fastest path alone", disturbed=True)
    found = [{Direction.UP: up, Direction.DOWN: disturbed}] * 3 + [{Direction.UP: up, Direction.DOWN: AccessEstimate(
        5e6, "found")}] + [{Direction.UP: up, Direction.DOWN: disturbed}]
    at: list[float] = []

    def measure_access(transport, paths, config, stop):
        at.append(time.monotonic())
        return found[min(len(at), len(found)) - 1]

    monkeypatch.setattr("p2ptrain.agent.links.measure_access", measure_access)
    access = AccessConfig(retry_s=0.3, retries=2, refresh_s=2.5)
    lines: queue.Queue = queue.Queue()
    prober = LinkProber(None, Board(), LinksConfig(min_rounds=1, round_pause_s=0.05, refresh_s=60.0, access=access),
                        on_access=lines.put, rng=random.Random(0)).start()
    try:
        prober.set_peers(peers)
        assert lines.get(timeout=10) == {Direction.UP: 2e6}
        deadline = time.monotonic() + 15
        while len(at) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines.get(timeout=1) == {Direction.UP: 2e6, Direction.DOWN: 5e6}
    finally:
        prober.stop(timeout_s=10)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert len(gaps) >= 4, at
    # two retries after the first, then refresh_s; found at the refresh, so the disturbed one after it waits too
    assert all(0.3 <= g < 2.0 for g in gaps[:2]) and gaps[2] >= 2.5 and gaps[3] >= 2.5, gaps
    with pytest.raises(ValueError, match="retry_s"):
        AccessConfig(retry_s=0.0)


def test_a_measurement_beyond_what_a_record_can_say_is_published_at_its_bound(monkeypatch):
    # loopback on a busy machine once measured 1.7 Tbit/s: the agent published it, the record refused it,
    # and the agent ended (CI15); now the row says the bound
    peer = base58.b58encode(b"\x12\x20" + bytes(32)).decode()
    monkeypatch.setattr("p2ptrain.agent.links.measure_link",
                        lambda transport, p, config, stop: LinkEstimate(0.01, 1695.47, 20))
    rows: queue.Queue = queue.Queue()
    prober = LinkProber(None, Board(), LinksConfig(min_rounds=1, round_pause_s=0.05), on_publish=rows.put,
                        rng=random.Random(0)).start()
    try:
        prober.set_peers([peer])
        assert rows.get(timeout=10) == {peer: LinkMeasurement(0.01, 1000.0)}
    finally:
        prober.stop(timeout_s=10)


def links(summary: dict) -> tuple[np.ndarray, np.ndarray]:
    """The leader's measured latency and bandwidth matrices, in the network's units."""
    return (np.array(summary["measured"]["latency_ms"], dtype=float),
            np.array(summary["measured"]["bandwidth_gbps"], dtype=float))


def assert_every_link_measured_and_none_faster_than_emulated(latency: np.ndarray, bandwidth: np.ndarray,
                                                             true_latency_ms: np.ndarray) -> None:
    """Every link measured; none shorter than its emulated latency (a probe's one-way delay is its emulated
    arrival, or later when the machine is busy: never earlier), whatever the load."""
    off = ~np.eye(len(latency), dtype=bool)
    assert np.isfinite(latency[off]).all() and np.isfinite(bandwidth[off]).all() and (bandwidth[off] > 0).all()
    assert (latency[off] >= true_latency_ms[off] * (1 - FLOAT32_REL)).all(), (latency, true_latency_ms)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_agents_measure_every_emulated_link_and_a_slower_one_slower(tmp_path):
    # three devices, time scale 1 and size factor 1: the links are emulated exactly as written; 0-1 is ten
    # times slower than 0-2 in latency and in bandwidth
    latency_ms = [[0, 50, 5], [50, 0, 20], [5, 20, 0]]
    bandwidth_gbps = [[1, 0.020, 0.200], [0.020, 1, 0.050], [0.200, 0.050, 1]]
    cluster = tmp_path / "three.json"
    cluster.write_text(json.dumps({"devices": [{"name": f"d{i}"} for i in range(3)], "latency_ms": latency_ms,
                                   "bandwidth_gbps": bandwidth_gbps}))
    code, summary, stderr = run_swarm(tmp_path / "swarm", "--agents", "3", "--stages", "3", "--steps", "1",
                                      "--cluster", str(cluster), "--batch-size", "4")
    assert code == 0, stderr[-3000:]
    assert summary["emulation"] == {"time_scale": 1.0, "size_factor": 1.0, "compute_scale": 1.0}
    latency, bandwidth = links(summary)  # the leader's cluster: both directions combined, in the file's units
    assert_every_link_measured_and_none_faster_than_emulated(latency, bandwidth, np.array(latency_ms, dtype=float))
    assert latency[0, 1] > latency[0, 2] and bandwidth[0, 1] < bandwidth[0, 2], summary["measured"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_leader_plans_the_worldwide_swarm_it_measured(tmp_path):
    code, summary, stderr = run_swarm(tmp_path, "--agents", "8", "--stages", "2", "--steps", "1",
                                      "--scenario", "worldwide")
    assert code == 0, stderr[-3000:]
    truth = scenario("worldwide", 8)
    latency, bandwidth = links(summary)  # converted back from the emulated links (time scale, size factor)
    assert_every_link_measured_and_none_faster_than_emulated(latency, bandwidth, truth.latency_ms)
    near, far = (1, 2), (4, 5)  # 11 ms and 238 ms apart
    assert latency[near] < latency[far], summary["measured"]
    # bandwidths in the network's units: a factor missed in the conversion is 20x (time scale) or more
    off = ~np.eye(8, dtype=bool)
    assert 0.5 < float(np.median(bandwidth[off] / truth.bandwidth_gbps[off])) < 2.0, summary["measured"]
    # the leader planned with the links it measured, and found that network's best plan
    diagonal = np.eye(8, dtype=bool)
    measured = Cluster(truth.devices, np.where(diagonal, truth.latency_ms, latency),
                       np.where(diagonal, truth.bandwidth_gbps, bandwidth))
    workload = Workload(**summary["workload"])  # this run's volumes over the size factor, as the leader used
    leader_plan_s = make_objective("dtfm", measured, workload, 2).evaluate(np.array(summary["plan"]["pipelines"])).cost_s
    assert leader_plan_s == pytest.approx(summary["predicted_cost_s"], rel=1e-6)
    assert leader_plan_s <= 1.02 * schedule(measured, workload, 2).cost.cost_s, summary["plan"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_agents_that_measure_a_few_partners_plan_on_estimated_links_and_train_exactly(tmp_path):
    # six agents of the world-wide network, each measuring about two partners (``links.partners``): the leader
    # plans once every trainer measured its partners, on estimates for the rest, and the run trains exactly
    code, summary, stderr = run_swarm(tmp_path, "--agents", "6", "--stages", "2", "--steps", "2",
                                      "--link-partners", "2", timeout_s=280)
    assert code == 0, stderr[-3000:]
    assert summary["finished"]
    index = {peer: int(k) for k, peer in summary["peers"].items()}
    rows = {}
    for k in range(6):  # each agent's last published row: whom it measured
        published = [e for e in events(tmp_path / f"agent-{k}.events.jsonl") if e["event"] == "links"]
        assert published, f"agent {k} published no links row"
        rows[k] = {index[p] for p in published[-1]["row"]}
    assert all(rows.values()) and sum(map(len, rows.values())) < 6 * 5, rows  # a few partners each, not everyone
    assert all(k in rows[j] for k, r in rows.items() for j in r), rows  # both ends measure a pair
    measured = {tuple(sorted((a, b))) for a, r in rows.items() for b in r}
    # the first plan names the version of each member's row its leader planned with: one that member published
    logs = {k: events(tmp_path / f"agent-{k}.events.jsonl") for k in range(6)}
    plan = next(e for evs in logs.values() for e in evs if e["event"] == "plan")
    assert set(plan["rows"]) == set(index), plan["rows"]
    for peer, version in plan["rows"].items():
        assert version in {e["version"] for e in logs[index[peer]] if e["event"] == "links"}, (peer, version)
    estimated = {tuple(pair) for pair in summary["estimated_links"]}
    # the leader's estimated pairs are exactly those nobody measured (read from its last rows, the same)
    assert estimated and estimated == {(a, b) for a in range(6) for b in range(a + 1, 6)} - measured, (estimated, measured)
    # the summary's per agent: measured and estimated links among the six, as the leader planned
    assert summary["links_by_agent"] == {str(a): [sum(1 for p in measured if a in p), sum(1 for p in estimated if a in p)]
                                         for a in range(6)}, summary["links_by_agent"]
    # one of the five followers is none of the plan's 4 checkers (``leadership.checkers``): it followed on their word
    logs_text = [(tmp_path / f"agent-{k}.log").read_text() for k in range(6)]
    vouched = [k for k, text in enumerate(logs_text) if "followed on the word of its 4 checkers" in text]
    assert len(vouched) == 1 and "checked:" not in logs_text[vouched[0]], vouched
    # a follower reads the plan records when its leader's heartbeat answers announce a plan (``PeerStatus.plan``), and
    # the peer records when the leader's digest of them is not its own (``PeerStatus.peers``): not every poll, as the
    # leader does both (and the next in line the peer records)
    leader, second = (index[p] for p in sorted(index)[:2])
    assert any(e["event"] == "plan" for e in logs[leader])
    reads = {k: {kind: counts["reads"] for kind, counts in [e for e in evs if e["event"] == "dht_traffic"][-1]["kinds"].items()}
             for k, evs in logs.items()}
    assert all(reads[k]["plan"] * 2 < reads[leader]["plan"] for k in reads if k != leader), reads
    assert all(reads[k]["peers"] * 2 < reads[leader]["peers"] for k in reads if k not in (leader, second)), reads
    latency, bandwidth = links(summary)
    truth = scenario("worldwide", 6)
    for a, b in measured:  # a measured link never shorter than emulated; an estimated one is a measured one's
        assert latency[a, b] >= truth.latency_ms[a, b] * (1 - FLOAT32_REL), (a, b, latency)
    measured_values = {round(float(latency[a, b]), 6) for a, b in measured}
    assert all(round(float(latency[a, b]), 6) <= max(measured_values) for a, b in estimated)
    run = config_from_dict(TrainConfig, summary["config"])
    reference = train_reference(dataclasses.replace(run, replicas=summary["replicas"])).losses
    assert len(summary["losses"]) == len(reference)
    for got, expected in zip(summary["losses"], reference, strict=True):
        assert abs(got - expected) <= 1e-4 * abs(expected), (summary["losses"], reference)


def test_the_line_published_is_the_declared_else_the_emulated_device_s_else_the_measured():
    measured = {Direction.UP: 2e6, Direction.DOWN: 5e6}  # bytes/s: 16 and 40 Mbit/s
    nothing = {"uplink_gbps": None, "downlink_gbps": None}
    assert line_to_publish(nothing, None, measured) == pytest.approx({"uplink_gbps": 0.016, "downlink_gbps": 0.04})
    assert line_to_publish(nothing, None, {}) == {}  # unknown: nothing published
    declared = {"uplink_gbps": 20.0, "downlink_gbps": None}  # Mbit/s, as [links] says it
    assert line_to_publish(declared, None, measured) == pytest.approx({"uplink_gbps": 0.02, "downlink_gbps": 0.04})
    emulated = {"uplink_gbps": 1.25e6, "downlink_gbps": None}  # bytes/s; the network gives this device no downlink
    assert line_to_publish(nothing, emulated, measured) == pytest.approx({"uplink_gbps": 0.01})


BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/QmXeJB72XYYV2FhvJSzajoDCZH2viUzKbdPztJwNH16TXW"


class PeerBoard:
    def __init__(self):
        self.records: list[PeerRecord] = []

    def publish_peer(self, record: PeerRecord) -> bool:
        self.records.append(record)
        return True


class Events:
    def __init__(self):
        self.written: list[tuple[str, dict]] = []

    def write(self, kind: str, **fields) -> None:
        self.written.append((kind, fields))


def agent_stand_in(links: LinksConfig, measured: dict) -> SimpleNamespace:
    """What ``Agent._on_access`` touches: its link shaping, prober, DHT, events, last record."""
    config = AgentConfig(initial_peers=(BOOTSTRAP,), links=links)
    return SimpleNamespace(_shaping=LinkShaping(config), prober=SimpleNamespace(access=measured), dht=PeerBoard(),
                           events=Events(), _peer_record=PeerRecord(device_name="cpu", memory_gb=8.0, tflops=1.0))


def test_an_agent_publishes_its_measured_line_in_its_peer_record_where_nothing_declared_wins():
    measured = {Direction.UP: 2e6}  # 16 Mbit/s; the downlink unknown
    agent = agent_stand_in(LinksConfig(), measured)
    Agent._on_access(agent, measured)
    assert [(r.uplink_gbps, r.downlink_gbps) for r in agent.dht.records] == [(pytest.approx(0.016), None)]
    assert agent.events.written == [("access", {"uplink_gbps": pytest.approx(0.016)})]
    Agent._on_access(agent, measured)  # nothing new: nothing published
    assert len(agent.dht.records) == 1
    declared = agent_stand_in(LinksConfig(uplink_mbps=20.0, downlink_mbps=50.0), measured)
    assert not declared._shaping.measures_access()  # both declared: the prober does not measure
    Agent._on_access(declared, measured)
    assert declared.dht.records[-1].uplink_gbps == pytest.approx(0.02)  # the declared line, not the measured
    assert agent_stand_in(LinksConfig(uplink_mbps=20.0), measured)._shaping.measures_access()
    assert not agent_stand_in(LinksConfig(measure_access=False), measured)._shaping.measures_access()


MBIT = 1e6 / 8  # bytes/s in a Mbit/s
QUICK = ProbeConfig(pings=6, transfers=3, rtt_multiple=3.0, min_transfer_s=0.15, deadline_s=30.0)


def _measure_line(prober: LinkProber, peers: list[str], timeout_s: float, both: bool = False) -> None:
    """Wait for the prober's first measurement of its line (``both``: until both directions are known, a
    measurement that came out disturbed is measured again after ``retry_s``, or its retries are spent)."""
    prober.set_peers(peers)
    deadline = time.monotonic() + timeout_s
    measurements = 1 + (prober.config.access.retries if both else 0)
    while (prober.access_measurements < measurements and not (prober.access_measurements and
                                                               (not both or len(prober.access) == len(Direction)))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert prober.access_measurements >= 1, "the prober did not measure its line in time"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_prober_measures_its_emulated_home_line_after_its_pairs_and_a_plain_peer_finds_none(monkeypatch):
    """Four transports, every path 5 ms and 100 Mbit/s; ``home`` has a 16 Mbit/s uplink and a 40 Mbit/s
    downlink. Its prober measures the three pairs (each alone at its uplink's 16 Mbit/s), then its line within
    25 % of the emulated one, which it hands on (the agent puts it in its peer record); a peer without a line
    of its own measures its pairs and publishes no line. The first measurement of the line goes before the
    row that covers every peer, which the leader waits for to plan."""
    # these transports' peer IDs are Ed25519 keys, which a links record does not take: keep the rows as they are
    monkeypatch.setattr("p2ptrain.agent.links.LinksRecord", SimpleNamespace(from_peers=lambda row, *_: row))
    config = TransportConfig(call_timeout_s=20.0)
    transports: list[Transport] = []
    try:
        home = Transport("links-test", config)
        transports.append(home)
        transports += [Transport("links-test", config, initial_peers=home.visible_maddrs) for _ in range(3)]
        for a in transports:
            for b in transports:
                if a is not b:
                    a.emulator.set_link(str(b.peer_id), 5e-3, 100 * MBIT)
        home.emulator.set_access(16 * MBIT, 40 * MBIT)
        links = LinksConfig(probe=QUICK, round_pause_s=0.1, access=AccessConfig(deadline_s=90.0, retry_s=1.0))
        lines: queue.Queue = queue.Queue()
        board = Board()
        order: list[str] = []  # the line first, then the row that covers every peer (the leader plans on it)
        prober = LinkProber(home, board, links, on_access=lambda line: (order.append("line"), lines.put(line)),
                            on_publish=lambda row: order.append(f"row of {len(row)}"), rng=random.Random(0)).start()
        try:
            _measure_line(prober, [str(t.peer_id) for t in transports[1:]], timeout_s=150, both=True)
        finally:
            prober.stop(timeout_s=30)
        assert set(board.rows[-1]) == {str(t.peer_id) for t in transports[1:]}
        assert "line" in order and order.index("line") < order.index("row of 3"), order
        line = lines.get(timeout=1)
        while not lines.empty():  # a direction that came out disturbed at first, found when measured again
            line = lines.get(timeout=1)
        assert line[Direction.UP] == pytest.approx(16 * MBIT, rel=0.25), line
        assert line[Direction.DOWN] == pytest.approx(40 * MBIT, rel=0.25), line
        plain = transports[1]
        prober = LinkProber(plain, Board(), links, on_access=lines.put, rng=random.Random(1)).start()
        try:
            _measure_line(prober, [str(t.peer_id) for t in transports if t is not plain], timeout_s=150)
        finally:
            prober.stop(timeout_s=30)
        assert prober.access == {} and lines.empty()
    finally:
        for transport in reversed(transports):
            transport.shutdown()


def test_a_first_line_measurement_a_busy_peer_refused_goes_again_before_the_row_that_completes_ours(monkeypatch):
    """A peer of ours in another measurement refuses the access probe ``busy`` (``probe_gate``): the prober
    measures the line again after a short pause, and still before it publishes the row that covers every peer
    (the leader's first plan should have our line)."""
    rng = random.Random(11)
    peers = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(2))
    monkeypatch.setattr("p2ptrain.agent.links.measure_link", lambda transport, peer, config, stop: LinkEstimate(5.0, 0.1, 20))
    tries: list[float] = []

    def measure_access(transport, paths, config, stop):
        tries.append(time.monotonic())
        if len(tries) <= 2:
            raise MessageRejected("in another link measurement: probe again shortly", code=Refusal.BUSY)
        return {Direction.UP: AccessEstimate(2e6, "found"), Direction.DOWN: AccessEstimate(None, "unknown")}

    monkeypatch.setattr("p2ptrain.agent.links.measure_access", measure_access)
    order: list[str] = []
    prober = LinkProber(None, Board(), LinksConfig(min_rounds=1, round_pause_s=0.05, access=AccessConfig()),
                        on_access=lambda line: order.append("line"), on_publish=lambda row: order.append(f"row of {len(row)}"),
                        rng=random.Random(0)).start()
    try:
        prober.set_peers(peers)
        deadline = time.monotonic() + 15
        while "row of 2" not in order and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        prober.stop(timeout_s=10)
    assert len(tries) >= 3 and all(0.1 <= b - a < 2.0 for a, b in zip(tries, tries[1:3], strict=False)), tries
    assert "line" in order and order.index("line") < order.index("row of 2"), order


def test_the_prober_says_where_its_time_went_once_its_row_covers_every_peer(monkeypatch, caplog):
    """A peer busy in another measurement refuses the first try; the other is measured at once. Once the row
    covers both, one line says what the time went to: measuring, the refusal, publishing."""
    rng = random.Random(5)
    busy, free = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(2))
    calls: dict[str, int] = {}

    def measure_link(transport, peer, config, stop):
        calls[peer] = calls.get(peer, 0) + 1
        time.sleep(0.05)
        if peer == busy and calls[peer] == 1:
            raise MessageRejected("in another measurement", code=Refusal.BUSY)
        return LinkEstimate(10.0, 1.0, 20)

    monkeypatch.setattr("p2ptrain.agent.links.measure_link", measure_link)
    rows: queue.Queue = queue.Queue()
    prober = LinkProber(None, Board(), LinksConfig(min_rounds=1, round_pause_s=0.05, measure_access=False),
                        on_publish=rows.put, rng=random.Random(0))
    with caplog.at_level("INFO", logger="p2ptrain.agent.links"):
        prober.start()
        try:
            prober.set_peers([busy, free])
            while set(rows.get(timeout=10)) != {busy, free}:
                pass
        finally:
            prober.stop(timeout_s=10)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("links to all")]
    assert len(said) == 1 and calls == {busy: 2, free: 1}
    figures = {word: float(s) for s, word in re.findall(r"([\d.]+) s (measuring|refused|pausing|on our own)", said[0])}
    assert figures["measuring"] >= 0.1 and figures["refused"] >= 0.05 and figures["on our own"] == 0
    assert "(1 times)" in said[0] and figures["pausing"] > 0  # the round that met the busy peer paused


def test_the_prober_measures_on_while_a_store_of_its_row_hangs_and_stores_only_the_newest_row(monkeypatch):
    """The first store hangs (a loaded DHT: up to its 10 s request timeout); the prober measures the other peers
    meanwhile, and once the store returns the row with every peer is stored next: the rows in between, never
    (three measurements, at most two stores)."""
    rng = random.Random(7)
    peers = sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(3))
    measured: list[str] = []

    def measure_link(transport, peer, config, stop):
        measured.append(peer)
        return LinkEstimate(10.0, 1.0, 20)

    class HangingBoard(Board):
        def __init__(self):
            super().__init__()
            self.release = threading.Event()

        def publish_links(self, record: LinksRecord) -> bool:
            if not self.rows:
                assert self.release.wait(timeout=30)
            return super().publish_links(record)

    monkeypatch.setattr("p2ptrain.agent.links.measure_link", measure_link)
    board = HangingBoard()
    prober = LinkProber(None, board, LinksConfig(min_rounds=1, round_pause_s=0.05, measure_access=False),
                        rng=random.Random(0)).start()
    try:
        prober.set_peers(peers)
        deadline = time.monotonic() + 10
        while len(measured) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(measured) == peers and board.rows == []  # all measured while the first store hangs
        board.release.set()
        while len(board.rows) < 2 and time.monotonic() < deadline + 10:
            time.sleep(0.02)
    finally:
        prober.stop(timeout_s=10)
    counts = [len(row.resolve(peers)) for row in board.rows]  # the hanging store's row: whatever was newest then
    assert len(counts) <= 2 and counts[-1] == 3
