"""Untrusted members: who a failure re-plan blames and quarantines, the back-off, and the links rows as
claims that the other end checks (``agent.quarantine``, ``ReplanWatch`` culprits, ``build_cluster``)."""

from __future__ import annotations

import dataclasses

import networkx as nx
import numpy as np
import pytest
from test_churn_units import PLAN, A, B, C, D, E
from test_plan_check import measured_world, workload_for

from p2ptrain.agent.churn.cover import cover_size, essential
from p2ptrain.agent.churn.quarantine import Quarantine
from p2ptrain.agent.churn.replan import BLAMED_HALT_S, FAILURE, ReplanWatch, blame_roots, disputes_of
from p2ptrain.agent.config import ChurnConfig, EmulationSettings, PlanConfig
from p2ptrain.agent.epoch import blamed_peer
from p2ptrain.agent.leadership.plan_maker import build_cluster, kept_apart, meetings, run_workload
from p2ptrain.errors import MessageRejected, PeerFailed, PeerTimeoutError, StreamClosed
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, ProgressRecord, RecordError
from p2ptrain.net.transport.status import FAIL, TRAIN, PeerStatus
from p2ptrain.planning import make_objective
from p2ptrain.planning.scenarios import scenario
from p2ptrain.runtime.config import TrainConfig


def halted(step: int, blame: str | None = None) -> ProgressRecord:
    return ProgressRecord(1, step, None, 0.0, halted=True, kept=2, blame=blame)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_back_off_doubles_per_repeat_caps_and_is_forgotten_after_a_quiet_spell():
    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock)
    assert q.add(A, 1) == 60.0 and q.held() == {A} and q.without([A, B]) == (B,)
    clock.now = 59.0
    assert q.remaining_s(A) == pytest.approx(1.0)
    clock.now = 60.5
    assert q.held() == set()  # back after its back-off: a transient failure costs one
    assert [q.add(A, e) for e in range(2, 6)] == [120.0, 240.0, 480.0, 600.0]  # repeats: longer, up to the cap
    clock.now += 600.5 + 601.0  # no failure for longer than the cap: a fresh start
    assert q.add(A, 6) == 60.0


def test_one_failed_epoch_is_one_strike_however_often_the_leader_reads_it():
    # a leader that cannot re-plan yet (too few peers) reads the same failure at every poll: it once
    # escalated a lagging honest peer's back-off from 60 s to the 3600 s cap within three seconds
    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2)
    assert q.add(A, 4) == 60.0
    clock.now = 0.5
    assert [q.add(A, 4) for _ in range(10)] == [None] * 10 and q.remaining_s(A) == pytest.approx(59.5)
    clock.now = 61.0
    assert q.held() == set() and q.add(A, 4) is None  # its back-off ended: that failure is paid for
    assert q.add(A, 5) == 120.0  # a failure of another epoch is a repeat
    assert q.blame(B, 4) == 1 and q.blame(B, 4) is None  # a blame read again is not counted again
    assert q.blame(B, 5) == 2 and q.add(B, 5) == 60.0  # ... nor after it got the peer quarantined
    assert q.blame(B, 5) is None and q.add(B, 5) is None


def test_a_failure_names_its_culprits_the_dead_and_the_silent():
    # B died; C neither trains nor halts; A blamed D, but D halted too (timeouts cascade): no culprit
    progress = {A: halted(4, blame=D), D: halted(4), E: halted(4)}
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=5))
    live = [A, C, D, E]
    assert watch.check(PLAN, live, progress, steps=10, checkpoints=[], now=0.0) is None  # C may still halt
    replan = watch.check(PLAN, live, progress, steps=10, checkpoints=[], now=6.0)
    assert replan.kind == FAILURE and replan.culprits == (B, C)
    assert C not in replan.members and D in replan.members and "left out" in replan.reason
    assert replan.blamed == (D,)  # counted by the leader (``Quarantine.blame``), not quarantined


def test_blames_are_counted_where_their_chain_ends():
    assert blame_roots({}) == set()
    assert blame_roots({A: B, C: A, D: B}) == {B}  # C waited on A, which waited on B: B's failure
    assert blame_roots({A: B, B: A, C: A}) == {A, B}  # B accuses its accuser: both count
    assert blame_roots({A: B, B: C, C: B, D: E}) == {B, C, E}
    # the watch hands the leader the roots that halted (dead or silent ones are culprits already)
    progress = {A: halted(4, blame=D), C: halted(4, blame=A), D: halted(4), E: halted(4, blame=D)}
    replan = ReplanWatch(ChurnConfig(halt_timeout_s=5)).check(PLAN, [A, C, D, E], progress, steps=10,
                                                              checkpoints=[], now=6.0)
    assert replan.culprits == (B,) and replan.blamed == (D,)


def test_a_refusal_names_a_cause_and_the_failed_calls_it_caused_do_not_turn_on_its_finder():
    # A's check found B's work wrong; B's calls to A then failed (A halted on its finding): B, not A
    assert blame_roots({A: B, B: A}, refusals={A}) == {B}
    assert blame_roots({A: B, B: A}) == {A, B}  # the same two blames as failed calls: both count, as before
    # a chain of failed calls that reaches a refuser ends at what it refused
    assert blame_roots({A: B, B: A, C: A}, refusals={A}) == {B}
    assert blame_roots({C: D, D: A, A: B}, refusals={A}) == {B}
    # two refusals of each other (word against word): each side counts
    assert blame_roots({A: B, B: A}, refusals={A, B}) == {A, B}
    # the watch hands the leader the refused peer only (``ProgressRecord.refused``)
    progress = {A: dataclasses.replace(halted(4, blame=D), refused=True), D: halted(4, blame=A), E: halted(4)}
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=5))
    assert watch.check(PLAN, [A, C, D, E], progress, steps=10, checkpoints=[], now=0.0) is None  # C may halt
    assert watch.check(PLAN, [A, C, D, E], progress, steps=10, checkpoints=[], now=6.0).blamed == (D,)


def test_two_members_that_refuse_each_other_without_evidence_are_a_dispute_counted_by_counterpart():
    refusing = {A: dataclasses.replace(halted(4, blame=B), refused=True),
                B: dataclasses.replace(halted(4, blame=A), refused=True),
                C: dataclasses.replace(halted(4, blame=D), refused=True, also=(A,)), D: halted(4, blame=C)}
    assert disputes_of(refusing, {A, B, C, D}) == ((A, B),)  # C's refusal of D is answered by a failed call only
    assert disputes_of(refusing, {A, C, D}) == ()
    with_evidence = {**refusing, B: dataclasses.replace(refusing[B], evidence=b"x")}
    assert disputes_of(with_evidence, {A, B}) == ()  # evidence is judged, not counted
    # the watch hands both sides of the dispute to the leader
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=5))
    replan = watch.check(PLAN, [A, B, C, D, E], {A: refusing[A], B: refusing[B], C: halted(4), D: halted(4),
                                                 E: halted(4)}, steps=10, checkpoints=[], now=6.0)
    assert replan.blamed == (A, B) and replan.disputes == ((A, B),)

    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0)
    assert q.dispute(A, B, 1) == 1 and q.dispute(B, A, 1) == 1 and q.apart() == {frozenset((A, B))}
    assert q.dispute(A, B, 1) is None  # the same epoch read again
    clock.now = 10.0
    assert q.dispute(C, A, 2) == 1  # the rogue A, kept apart from B, disputes with C: C's first ...
    assert q.dispute(A, C, 2) == 2  # ... A's second counterpart: the caller quarantines A, not B nor C
    assert not q.explained(A) and q.explained(B) and q.explained(C)  # B - A - C: A explains both
    q.add(A, 2)
    assert q.counterparts(B) == {A} and q.counterparts(A) == set()  # A's disputes forgotten once it went
    assert q.apart() == {frozenset((A, B)), frozenset((A, C))} and q.live_disputes() == []  # A explained them
    assert q.suspects() == {A, B, C}
    # a pair that could not be kept apart and disputed again: both reach the count, as blames by epoch do
    assert q.dispute(D, E, 3) == 1 and q.dispute(D, E, 4) == 2 and q.dispute(E, D, 4) == 2
    assert not q.explained(D) and not q.explained(E)
    clock.now = 400.0
    assert q.apart() == set() and q.dispute(B, C, 5) == 1  # past the window: forgotten
    # two colluders each dispute with one honest peer; one of them is caught on a proof: one count left
    q1, q2 = (Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0) for _ in range(2))
    assert q1.dispute(E, A, 9) == 1 and q1.dispute(E, B, 10) == 2  # (the caller would quarantine E here ...)
    assert not q1.explained(E)
    assert q2.dispute(E, A, 9) == 1
    q2.add(A, 10, proven=True)  # ... but A's refusal by the leader's own check came first
    assert q2.dispute(E, B, 10) == 1 and q2.counterparts(E) == {B}
    # a peer blamed at the root of one failure, then in a dispute: two counts (and the reverse)
    assert q.blame(B, 6) == 2
    assert q.blame(C, 7) == 2 and q.blame(C, 8) == 1  # its count started over


def test_an_honest_peer_that_two_colluders_disputed_with_in_turn_is_explained_by_them():
    """The campaign's ``clean_commit @ colluding``: rogues 1 and 2 dispute with their receivers 4 and 5 (epoch
    0), then, re-paired, with 3 and 4 (epoch 1). 4 has two counterparts as each rogue has; counted by counterpart
    alone it went with them. The path 3 - 1 - 4 - 2 - 5 has one smallest set of liars, {1, 2}."""
    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0)
    p = {i: f"peer-{i}" for i in range(6)}
    q.disputed([(p[1], p[4]), (p[2], p[5])], 0)
    for a, b in ((p[1], p[4]), (p[4], p[1]), (p[2], p[5]), (p[5], p[2])):
        assert q.dispute(a, b, 0) == 1
    clock.now = 5.0
    q.disputed([(p[1], p[3]), (p[2], p[4])], 1)  # every dispute of the epoch before any is counted
    judged = {}
    for a, b in ((p[4], p[2]), (p[1], p[3]), (p[3], p[1]), (p[2], p[4])):  # the honest 4 first: order is moot
        count = q.dispute(a, b, 1)
        judged[a] = count >= 2 and not q.explained(a)
        if judged[a]:
            q.add(a, 1)
    assert judged == {p[4]: False, p[1]: True, p[3]: False, p[2]: True}
    assert q.held() == {p[1], p[2]} and q.live_disputes() == []
    # a square (each rogue disputed with both honest peers): two smallest sets, nobody is needed yet ...
    q2 = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0)
    q2.disputed([(p[1], p[4]), (p[1], p[5]), (p[2], p[4]), (p[2], p[5])], 0)
    assert all(q2.dispute(a, b, 0) == 2 and q2.explained(a) for a, b in ((p[1], p[4]), (p[4], p[1])))
    # ... until a rogue, kept apart from both, disputes with a fresh peer
    q2.disputed([(p[1], p[0])], 1)
    assert not q2.explained(p[1]) and q2.explained(p[4]) and q2.explained(p[5])
    assert not q2.explained(p[2])  # {1, 2} is the one smallest set now


def test_the_peers_every_smallest_set_of_liars_needs():
    path = [(3, 1), (1, 4), (4, 2), (2, 5)]
    assert [v for v in range(6) if essential(path, v)] == [1, 2]
    assert cover_size(nx.Graph(path)) == 2
    star = [(0, 1), (0, 2), (0, 3)]
    assert [v for v in range(4) if essential(star, v)] == [0]
    assert not essential([(0, 1)], 0) and not essential([(0, 1)], 1)  # word against word: either
    triangle = [(0, 1), (1, 2), (0, 2), (2, 3)]  # not bipartite (rogues disputing with each other): branched
    assert cover_size(nx.Graph(triangle)) == 2 and essential(triangle, 2) and not essential(triangle, 3)
    odd = [(i, (i + 1) % 5) for i in range(5)]  # a five-cycle: 3, by branching; nobody in every smallest set
    assert cover_size(nx.Graph(odd)) == 3 and not any(essential(odd, v) for v in range(5))
    assert not essential(path, 9)  # on no edge: nothing to explain


def test_members_that_refused_each_other_are_placed_where_they_exchange_no_message():
    peers, records, rows = measured_world()
    cluster = build_cluster(peers[:4], records, rows, EmulationSettings())
    workload = workload_for(cluster, peers[:4])
    plan = {"stages": 2, "replicas": 2, "pipelines": [[0, 1], [2, 3]], "cost_s": 1.0}
    assert meetings(plan["pipelines"], [(0, 1)]) == 1 and meetings(plan["pipelines"], [(0, 2)]) == 1  # neighbours, group
    assert meetings(plan["pipelines"], [(0, 3)]) == 0
    config = PlanConfig(objective="dtfm")
    apart = kept_apart(plan, cluster, workload, [(0, 1)], config)
    assert meetings(apart["pipelines"], [(0, 1)]) == 0  # 0 and 1 on the diagonal now
    assert apart["cost_s"] == make_objective("dtfm", cluster, workload, 2).evaluate(np.array(apart["pipelines"])).cost_s
    assert kept_apart(plan, cluster, workload, [(0, 3)], config) is plan  # they never met: nothing changes
    # a swap that would leave a stage to peers on probation alone is not taken (``with_company`` came first)
    # (0 and 2, replicas of stage 0, part only if one moves to stage 1, leaving it to 1 and 2 or to 0 and 3)
    assert meetings(kept_apart(plan, cluster, workload, [(0, 2)], config)["pipelines"], [(0, 2)]) == 0
    assert kept_apart(plan, cluster, workload, [(0, 2)], config, probation=(1, 2)) == plan
    # 0 disputed with 1 and with 2: in a 2 x 2 grid only one of the two pairs can be apart
    both = kept_apart(plan, cluster, workload, [(0, 1), (0, 2)], config)
    assert meetings(both["pipelines"], [(0, 1), (0, 2)]) == 1


def test_two_colluders_that_each_disputed_with_one_honest_peer_are_not_handed_each_others_counterpart():
    """Rogues 0 and 2 disputed with their receivers 1 and 3. Each pair apart, and as few of the four meeting
    as can be: each rogue's next neighbours are peers no dispute touched, so the next disputes count a second counterpart
    against each rogue and a first against fresh honest peers (not a second against 1 and 3)."""
    cluster = scenario("worldwide", 8)
    workload = run_workload(TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2), 2, 4)
    plan = {"stages": 2, "replicas": 4, "pipelines": [[0, 1], [2, 3], [4, 5], [6, 7]], "cost_s": 1.0}
    config = PlanConfig(objective="dtfm")
    pairs = [(0, 1), (2, 3)]
    apart = kept_apart(plan, cluster, workload, pairs, config)
    assert meetings(apart["pipelines"], pairs) == 0
    # four disputants on two stages: two share each stage's group (the fewest meetings there can be), and
    # none is another's pipeline neighbour
    assert meetings(apart["pipelines"], [(a, b) for a in range(4) for b in range(a + 1, 4)]) == 2
    assert all(not (row[0] < 4 and row[1] < 4) for row in apart["pipelines"])
    assert sorted(d for row in apart["pipelines"] for d in row) == list(range(8))
    # the pairs alone are what a follower knows (``PlanRecord.apart``): its plan kept apart is the same
    assert kept_apart(plan, cluster, workload, pairs, config) == apart


def test_pairs_a_predecessor_kept_apart_stay_apart_for_their_window_but_count_against_nobody():
    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0)
    q.inherit({frozenset((A, B)), frozenset((A, C))})
    assert q.apart() == {frozenset((A, B)), frozenset((A, C))}
    assert q.counterparts(A) == set() and q.suspects() == set()  # a leader's word frames nobody
    clock.now = 200.0
    assert q.dispute(A, D, 3) == 1  # A's own first dispute here: one count, not three
    q.inherit({frozenset((A, B))})  # read again: its window still runs from the first read
    clock.now = 301.0
    assert q.apart() == {frozenset((A, D))}


def test_a_member_blamed_in_two_epochs_is_quarantined_though_it_halted():
    clock = Clock()
    q = Quarantine(60.0, 600.0, clock=clock, blame_epochs=2, blame_window_s=300.0)
    assert q.blame(D, 1) == 1 and q.held() == set()  # blamed once: an honest neighbour of a failure
    assert q.blame(D, 1) is None  # the same epoch's failure read again counts once
    clock.now = 100.0
    assert q.blame(D, 2) == 2  # the caller quarantines it now (``Judge.count_blames``) ...
    assert q.add(D, 2) == 60.0 and q.held() == {D}
    assert q.blame(D, 3) == 1  # ... and the count starts over
    clock.now = 100.0 + 301.0
    assert q.blame(D, 4) == 1  # blamed again only after the window: counted once again
    assert q.blame(E, 4) == 1 and q.blame(E, 5) == 2


def test_a_blamed_trainer_that_does_not_halt_is_not_waited_for_long():
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=120))
    progress = {A: halted(4, blame=B), C: halted(4), D: halted(4), E: halted(4)}  # B never halts
    assert watch.check(PLAN, [A, B, C, D, E], progress, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(PLAN, [A, B, C, D, E], progress, steps=10, checkpoints=[], now=BLAMED_HALT_S - 1) is None
    replan = watch.check(PLAN, [A, B, C, D, E], progress, steps=10, checkpoints=[], now=BLAMED_HALT_S + 0.1)
    assert replan.kind == FAILURE and replan.culprits == (B,) and B not in replan.members
    assert "blamed by a halted trainer" in replan.reason
    # an unblamed trainer that has not halted is waited for the full halt_timeout_s
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=120))
    progress = {A: halted(4), C: halted(4), D: halted(4), E: halted(4)}
    assert watch.check(PLAN, [A, B, C, D, E], progress, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(PLAN, [A, B, C, D, E], progress, steps=10, checkpoints=[], now=60.0) is None


def test_a_blamed_trainers_time_to_halt_counts_from_the_blame_not_from_the_first_halt():
    # epoch 1 of the cooperative swallower: C (the rogue) halts at once, blaming nobody (a spare's halted
    # record told it to); 15 s later the others' tensor deadlines cascade: A halts blaming B, which halts
    # a moment later. Counted from C's halt, B had no time at all: CI once quarantined it so.
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=30))
    live = [A, B, C, D, E]
    assert watch.check(PLAN, live, {C: halted(4)}, steps=10, checkpoints=[], now=0.0) is None
    cascade = {C: halted(4), A: halted(4, blame=B), D: halted(4), E: halted(4)}
    assert watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=15.0) is None  # B: blamed just now
    assert watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=15.0 + BLAMED_HALT_S - 1) is None
    replan = watch.check(PLAN, live, {**cascade, B: halted(4)}, steps=10, checkpoints=[], now=16.0 + BLAMED_HALT_S)
    assert replan.kind == FAILURE and replan.culprits == () and B in replan.members
    # one that does not halt is left out BLAMED_HALT_S after the blame, still within halt_timeout_s
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=30))
    assert watch.check(PLAN, live, {C: halted(4)}, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=15.0) is None
    replan = watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=15.1 + BLAMED_HALT_S)
    assert replan.culprits == (B,) and "blamed by a halted trainer: " + B in replan.reason
    # and never later than halt_timeout_s after the failure's first halt
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=30))
    assert watch.check(PLAN, live, {C: halted(4)}, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=25.0) is None
    assert watch.check(PLAN, live, cascade, steps=10, checkpoints=[], now=30.1).culprits == (B,)


def test_a_blamed_trainer_whose_heartbeat_says_it_halted_is_waited_for_like_any_other():
    # the cascade's last timeout often blames a peer that halted a moment later (A waited on B's reduce
    # shard while B waited on a rogue); B's heartbeat answer says so at once, while its halted record can
    # take a busy machine's DHT longer than BLAMED_HALT_S: B is no culprit (it once was, in CI)
    progress = {A: halted(4, blame=B), C: halted(4), D: halted(4), E: halted(4)}
    live = [A, B, C, D, E]
    for status, left_out_after in [(PeerStatus(FAIL, 1, 4), 120.0), (PeerStatus(TRAIN, 1, 4), BLAMED_HALT_S),
                                   (PeerStatus(FAIL, 0, 4), BLAMED_HALT_S)]:
        watch = ReplanWatch(ChurnConfig(halt_timeout_s=120))
        assert watch.check(PLAN, live, progress, 10, [], now=0.0, statuses={B: status}) is None
        assert watch.check(PLAN, live, progress, 10, [], now=left_out_after - 1, statuses={B: status}) is None
        replan = watch.check(PLAN, live, progress, 10, [], now=left_out_after + 0.1, statuses={B: status})
        assert replan.culprits == (B,), status  # a halted record that never comes: left out in the end
        assert ("no halted record came" in replan.reason) == (status.state == FAIL and status.epoch == 1)
    # its record arrives: it halted, a member of the next plan
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=120))
    assert watch.check(PLAN, live, progress, 10, [], now=0.0, statuses={B: PeerStatus(FAIL, 1, 4)}) is None
    replan = watch.check(PLAN, live, {**progress, B: halted(4)}, 10, [], now=BLAMED_HALT_S + 5,
                         statuses={B: PeerStatus(FAIL, 1, 4)})
    assert replan.kind == FAILURE and replan.culprits == () and B in replan.members and replan.blamed == (B,)


def test_a_trainer_the_leader_saw_stay_away_is_not_waited_for():
    # B answered the leader's heartbeats without ever taking up the epoch: it has nothing of it to halt, so the
    # re-plan leaves it out as soon as the others halted, not BLAMED_HALT_S (or halt_timeout_s) later
    progress = {A: halted(0, blame=B), C: halted(0, blame=A), D: halted(0), E: halted(0)}
    live = [A, B, C, D, E]
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=120))
    replan = watch.check(PLAN, live, progress, 10, [], now=0.0, absent=[B])
    assert replan.kind == FAILURE and replan.culprits == (B,) and B not in replan.members
    assert "never took up the epoch" in replan.reason
    # without the leader's own finding it is waited for (a blame alone proves nothing)
    assert ReplanWatch(ChurnConfig(halt_timeout_s=120)).check(PLAN, live, progress, 10, [], now=0.0) is None


def test_only_a_peers_own_failed_call_blames_it():
    plan = PLAN
    assert blamed_peer(PeerTimeoutError("no reply", peer=B), plan) == B
    assert blamed_peer(StreamClosed("broke", peer=C), plan) == C
    assert blamed_peer(MessageRejected("refused", peer=D), plan) == D
    assert blamed_peer(PeerFailed("aborted: another peer failed", peer=B), plan) is None
    # ... unless a call of ours had waited on a member for most of its deadline by then: stuck behind it
    assert blamed_peer(PeerFailed("aborted", stuck_on=C, stuck_s=9.0), plan) == C
    assert blamed_peer(PeerFailed("aborted", stuck_on="QmNotAMember", stuck_s=9.0), plan) is None
    assert blamed_peer(PeerTimeoutError("no reply", peer="QmNotAMember"), plan) is None
    assert blamed_peer(RuntimeError("local"), plan) is None and blamed_peer(None, plan) is None


def test_an_epoch_aborted_after_our_check_found_a_member_wrong_halts_on_our_finding():
    """The check runs in the next step's shadow: the abort of the peer that halted first can end our epoch
    before our finding is raised. We halt refusing what we found (the first with evidence), not on the abort."""
    from p2ptrain.agent.epoch import _own_finding
    from p2ptrain.verify.sum_check import Finding, VerificationFailed

    aborted = PeerFailed("epoch 3 was aborted: peer(s) B stopped epoch 3 on a failure", peer=B)
    assert _own_finding(aborted, []) is aborted  # nothing found: the abort, as before
    word = Finding(B, 3, 2, "pipeline", float("inf"), "it committed to another activation")
    proof = Finding(C, 3, 2, "sum", 9.0, "its sums are off", evidence=b"statement")
    halted_on = _own_finding(aborted, [word])
    assert isinstance(halted_on, VerificationFailed) and blamed_peer(halted_on, PLAN) == B and halted_on.also == ()
    both = _own_finding(PeerTimeoutError("no reply", peer=D), [word, proof])
    assert both.peer == C and both.also == (B,)  # the finding with evidence first, the other named
    refused = VerificationFailed(proof)
    assert _own_finding(refused, [word]) is refused  # a refusal raised already stands


def test_blame_rides_in_the_progress_record_and_must_name_a_peer():
    record = ProgressRecord(2, 4, None, 0.0, halted=True, kept=1, blame=B)
    assert ProgressRecord.decode(record.encode()).blame == B
    assert ProgressRecord.decode(ProgressRecord(2, 4, None, 0.0).encode()).blame is None
    with pytest.raises(RecordError):
        ProgressRecord(2, 4, None, 0.0, blame="not a peer id")


def _cluster(rows):
    peers = {p: PeerRecord(device_name="d", memory_gb=16.0, tflops=10.0) for p in (A, B, C)}
    return build_cluster([A, B, C], peers, {p: LinksRecord.from_peers(r) for p, r in rows.items()},
                         EmulationSettings())


def test_a_links_row_is_a_claim_the_other_end_checks(caplog):
    m = LinkMeasurement
    honest = {A: {B: m(20.0, 0.1), C: m(30.0, 0.2)}, B: {A: m(22.0, 0.3), C: m(25.0, 0.1)},
              C: {A: m(31.0, 0.2), B: m(25.0, 0.1)}}
    cluster = _cluster(honest)
    # honest asymmetry (0.1 vs 0.3 Gbit/s) is averaged as before: transfer times, not rates
    assert cluster.bandwidth_gbps[0, 1] == pytest.approx(2 / (1 / 0.1 + 1 / 0.3))
    assert cluster.latency_ms[0, 1] == pytest.approx(21.0)
    # C claims 0 ms and 900 Gbit/s to everyone: the other ends measured otherwise, the worse figure counts
    liar = dict(honest, **{C: {A: m(0.0, 900.0), B: m(0.0, 900.0)}})
    cluster = _cluster(liar)
    assert cluster.bandwidth_gbps[0, 2] == pytest.approx(0.2) and cluster.latency_ms[0, 2] == pytest.approx(30.0)
    assert cluster.bandwidth_gbps[1, 2] == pytest.approx(0.1) and cluster.latency_ms[1, 2] == pytest.approx(25.0)
    assert "2 link(s) measured very differently by their two ends" in caplog.text
    # a link only its claimant measured is never better than the best link both ends measured
    alone = {A: {B: m(20.0, 0.1)}, B: {A: m(22.0, 0.3), C: m(25.0, 0.1)}, C: {A: m(0.0, 900.0), B: m(25.0, 0.1)}}
    cluster = _cluster(alone)
    both = [cluster.bandwidth_gbps[0, 1], cluster.bandwidth_gbps[1, 2]]
    assert cluster.bandwidth_gbps[0, 2] == pytest.approx(max(both))
    assert cluster.latency_ms[0, 2] == pytest.approx(min(cluster.latency_ms[0, 1], cluster.latency_ms[1, 2]))
    assert np.isfinite(cluster.bandwidth_gbps).all()


def test_a_halt_missing_from_a_later_read_still_counts_and_the_wait_ends():
    """DHT reads under load may miss records: a halted trainer seen once stays halted for that epoch, so the
    wait for the others is not restarted by every read that misses it."""
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=30))
    live = [A, B, C, D, E]
    assert watch.check(PLAN, live, {A: halted(4)}, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(PLAN, live, {}, steps=10, checkpoints=[], now=10.0) is None  # A's record missing
    replan = watch.check(PLAN, live, {B: halted(4)}, steps=10, checkpoints=[], now=31.0)
    assert replan.kind == FAILURE and replan.culprits == tuple(sorted((C, D))) and replan.restart.step == 4


def test_a_refusal_whose_evidence_did_not_hold_is_no_refusal_nor_are_the_others_it_named():
    from p2ptrain.agent.leadership.judgement import without_cleared

    liar = dataclasses.replace(halted(4, blame=A), refused=True, also=(B, C), evidence=b"x")
    finder = dataclasses.replace(halted(4, blame=D), refused=True)
    progress = without_cleared({E: liar, A: finder}, {(A, 1)})  # E's evidence against A did not hold
    assert not progress[E].refused and progress[E].also == () and progress[E].blame == A  # (it raised, before)
    assert progress[A] == finder
