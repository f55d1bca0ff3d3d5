"""How often an agent reads every peer record (``agent.membership_reader``): every poll in a small run and for the
leader and the next in line; any other agent in a large run every n / r polls, and at once when a newer plan
appears."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import base58

from p2ptrain.agent.config import AgentConfig, MembershipConfig, PlanConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership.checkers import checkers
from p2ptrain.agent.leadership.membership import MembershipTracker
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.membership_reader import MembershipReader, group_fingers
from p2ptrain.agent.shaping import LinkShaping
from p2ptrain.net.dht.counters import DHTCounters
from p2ptrain.net.dht.records import PeerRecord, PlanRecord
from p2ptrain.net.transport.counters import ControlCounters
from p2ptrain.net.transport.status import Announced


def fake_peer_ids(n: int, seed: int = 0) -> list[str]:
    """Well-formed peer IDs (sha2-256 multihashes of random digests), sorted."""
    rng = random.Random(seed)
    return sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(n))


BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/QmXeJB72XYYV2FhvJSzajoDCZH2viUzKbdPztJwNH16TXW"
POLL_S = 0.05
PEERS = fake_peer_ids(41, seed=5)  # sorted: PEERS[0] leads, PEERS[1] is next in line


class Board:
    """The run's peer records; counts the reads."""

    def __init__(self, peers):
        self.records = {p: PeerRecord(device_name="cpu", memory_gb=8.0, tflops=1.0) for p in peers}
        self.reads = 0
        self.counters = DHTCounters()

    def read_peers(self):
        self.reads += 1
        return dict(self.records)


def reader_of(me: str, board: Board, read_all_up_to: int = 4, checker_count: int = 0) -> MembershipReader:
    config = AgentConfig(initial_peers=(BOOTSTRAP,), plan=PlanConfig(checkers=checker_count),
                         membership=MembershipConfig(expect=len(PEERS), poll_s=POLL_S, read_all_up_to=read_all_up_to))
    transport = SimpleNamespace(connect_all=lambda peers, *a: dict.fromkeys(peers), counters=ControlCounters(), announced=Announced())
    return MembershipReader(config, me, MembershipTracker(me), board, transport, SimpleNamespace(set_peers=lambda p: None),
                            None, LeaderWatch(10.0, 300.0), LinkShaping(config), EventLog(None))


PLAN = PlanRecord(epoch=2, membership=tuple(PEERS), stages=1, replicas=1, pipelines=((0,),), cost_s=1.0)


def test_an_agent_in_a_large_run_reads_every_peer_record_n_over_r_polls_apart():
    board = Board(PEERS)
    follower = reader_of(PEERS[-1], board)
    assert follower.read(None) is not None and board.reads == 1  # nothing read yet: at once
    assert follower.spacing(PLAN) == follower.spacing(None) == len(PEERS) / 4
    for plan in (None, PLAN, PLAN, PLAN):  # polls well within n / r polls: the last records, and the same view
        seen, membership = follower.read(plan)
        assert set(membership.ids) == set(PEERS)
    assert board.reads == 1
    time.sleep(POLL_S * len(PEERS) / 4)
    follower.read(PLAN)
    assert board.reads == 2
    # a newer plan: read at once (once per epoch), then spaced again
    time.sleep(2 * POLL_S)
    assert follower.behind(3) and not follower.behind(3) and not follower.behind(2)
    assert follower.read(PLAN, force=True) is not None and board.reads == 3
    assert follower.read(PLAN) is not None and board.reads == 3


def test_the_leader_the_next_in_line_and_small_runs_read_every_poll():
    board = Board(PEERS)
    for me in PEERS[:2]:
        reader = reader_of(me, board)
        reader.read(None)
        assert reader.spacing(PLAN) == 1.0
    small = Board(PEERS[:5])
    reader = reader_of(PEERS[4], small, read_all_up_to=16)
    for _ in range(3):
        reader.read(PLAN)
    assert small.reads == 3


class Heartbeats:
    """What ``MembershipReader`` asks of the liveness monitor: whom to ping, who is dead, the last answers."""

    def __init__(self):
        self.said, self.at = {}, {}

    def watch(self, peers):
        pass

    def dead(self):
        return frozenset()

    def statuses(self):
        return dict(self.said)

    def answered(self):
        return dict(self.at)


def test_a_follower_reads_the_peer_records_when_its_leaders_digest_is_not_its_own(monkeypatch):
    from p2ptrain.agent import membership_reader
    from p2ptrain.net.transport.status import PeerStatus, peers_digest

    monkeypatch.setattr(membership_reader, "PEERS_READ_S", 20 * POLL_S)
    board = Board(PEERS[:5])  # a small run: without the leader's word, every poll
    follower, heartbeats = reader_of(PEERS[4], board, read_all_up_to=16), Heartbeats()
    follower.liveness = heartbeats
    follower.read(None)
    assert board.reads == 1 and follower.transport.announced.peers == peers_digest(board.records)  # said in our answers
    heartbeats.said[PEERS[0]], heartbeats.at[PEERS[0]] = PeerStatus(peers=peers_digest(board.records)), time.monotonic()
    for _ in range(3):  # the leader read what we read: the last records stand
        follower.read(None)
    assert board.reads == 1
    board.records[PEERS[5]] = PeerRecord(device_name="cpu", memory_gb=8.0, tflops=1.0)  # a join the leader read
    heartbeats.said[PEERS[0]] = PeerStatus(peers=peers_digest(board.records))
    _, membership = follower.read(None)
    assert board.reads == 2 and PEERS[5] in membership.ids
    follower.read(None)
    assert board.reads == 2
    time.sleep(20 * POLL_S)  # ... and every PEERS_READ_S besides
    follower.read(None)
    assert board.reads == 3
    heartbeats.at[PEERS[0]] = time.monotonic() - 60.0  # the leader's answers are late: every poll again
    follower.read(None)
    follower.read(None)
    assert board.reads == 5
    leader = reader_of(PEERS[0], board, read_all_up_to=16)
    leader.liveness = heartbeats
    for _ in range(3):
        leader.read(None)
    assert board.reads == 8  # the leader reads every poll


def test_before_any_plan_a_large_run_pings_its_partners_and_the_first_two_and_judges_only_whom_it_pings():
    from p2ptrain.agent.config import EmulationSettings, PlanConfig
    from p2ptrain.agent.leadership.membership import Membership
    from p2ptrain.agent.leadership.plan_check import PlanGate
    from p2ptrain.runtime.config import TrainConfig

    board = Board(PEERS)  # 41 peers: beyond liveness.watch_all_up_to (32)
    me = PEERS[-1]
    reader = reader_of(me, board)
    view = Membership(dict(board.records))
    partners = set(PEERS[10:18])
    assert reader._watch_targets(view, None, partners) == {PEERS[0], PEERS[1], *partners}
    assert reader._watch_targets(view, PLAN, partners) == {PEERS[0], PEERS[1]}  # stage 0 alone: no neighbours
    # with checkers (``plan.checkers``), also the plan's: their answers say whether they refused a plan of its leader
    chosen = checkers(PLAN.membership, PLAN.leader, reader.config.run, 4)
    assert len(chosen) == 4 and reader_of(me, board, checker_count=4)._watch_targets(view, PLAN, partners) == \
        {PEERS[0], PEERS[1], *chosen} - {me}
    # before the first plan, the checkers of these members' first plan: their answers say how long they search it
    first = checkers(view.ids, view.leader, reader.config.run, 4)
    assert first - partners - {PEERS[0], PEERS[1], me}  # not pinged without it
    assert reader_of(me, board, checker_count=4)._watch_targets(view, None, partners) == \
        {PEERS[0], PEERS[1], *partners, *first} - {me}
    assert reader_of(PEERS[0], board)._watch_targets(view, None, partners) == set(PEERS[1:])  # the leader: everyone
    small = Membership({p: board.records[p] for p in PEERS[:8]})
    assert reader._watch_targets(small, None, set()) == set(PEERS[:8]) - {me}
    # in a plan: the pipeline neighbours and O(log) of the replica group, the same number watching each member
    wide = PlanRecord(epoch=3, membership=tuple(PEERS[:40]), stages=2, replicas=20,
                      pipelines=tuple((i, 20 + i) for i in range(20)), cost_s=1.0)
    for row in (0, 7, 19):
        me = wide.peer_at(row, 1)
        fingers = {wide.peer_at((row + d) % 20, 1) for d in (1, 2, 4, 8, 16, -1, -2, -4, -8, -16)}
        assert reader_of(me, board)._watch_targets(view, wide, set()) == {PEERS[0], PEERS[1], wide.peer_at(row, 0),
                                                                          *fingers} - {me}
    watched_by = [sum(wide.peer_at(r, 1) in reader_of(wide.peer_at(row, 1), board)._watch_targets(view, wide, set())
                      for row in range(20)) for r in range(20)]
    assert watched_by == [len(group_fingers(0, 20))] * 20  # 8 of the 19 others: each row watched alike

    # a first plan that leaves out a settled live peer: refused by an agent that pings it, not by one that cannot tell
    gate = PlanGate(me, TrainConfig(), PlanConfig(), EmulationSettings(), LeaderWatch(10.0, 300.0), 1.0,
                    read_rows=dict, workload_for=None, needed=len(PEERS) - 2)
    first = PlanRecord(epoch=0, membership=tuple(PEERS[:-2]), stages=1, replicas=1, pipelines=((0,),), cost_s=1.0)
    assert not gate.left_out(first, PEERS, lambda p: 60.0, lambda: True, watched={PEERS[0], PEERS[1]})
    assert gate.left_out(first, PEERS, lambda p: 60.0, lambda: True, watched={PEERS[-2]})


def test_an_agents_control_plane_a_minute_is_its_dht_calls_their_kb_and_its_pings_and_probes_kb(monkeypatch):
    """``ProgressRecord.traffic`` as the monitor shows it: totals since the counters started, a minute."""
    from p2ptrain.net import counters as counters_module
    from p2ptrain.net.dht.keys import RecordKind

    dht, control = DHTCounters(), ControlCounters()
    dht.add(RecordKind.PEER, stores=2, store_bytes=3_000, reads=10, read_bytes=40_000)
    dht.add(RecordKind.LINKS, reads=8, read_bytes=20_000, read_failures=1)
    control.add("ping", calls=100, bytes=9_000)
    control.add("probe", calls=20, bytes=1_000_000)
    monkeypatch.setattr(counters_module.time, "monotonic", lambda: dht.started + 120.0)  # two minutes on
    assert counters_module.traffic_per_minute(dht, control) == (10, 32, 504)
