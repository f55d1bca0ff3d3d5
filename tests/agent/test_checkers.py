"""Each plan's checkers (``agent.leadership.checkers``) and the members that follow it on their word
(``plan_check.PlanGate``), without I/O: real records, a real search where a member checks for itself."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from agent_helpers import measured_world

from p2ptrain.agent.config import AgentConfig, EmulationSettings, MembershipConfig, PlanConfig
from p2ptrain.agent.leadership import watching
from p2ptrain.agent.leadership.checkers import checkers, vouched
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_check import CHECKING_WAIT, LeaderWatch, PlanGate
from p2ptrain.agent.leadership.plan_maker import (
    build_cluster,
    cluster_order,
    make_plan,
    run_workload,
    trainers_and_spares,
)
from p2ptrain.agent.leadership.run_stages import RunStages
from p2ptrain.net.dht.fields import RecordError
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import (
    PlanRecord,
    ProgressRecord,
    decode_record,
)
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.status import TAKE, Announced, PeerStatus
from p2ptrain.planning import make_objective
from p2ptrain.runtime.config import TrainConfig

TRAIN = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
PEERS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def world():
    """Eight peers (IDs sorted) playing world-wide devices, their records and links rows, and two plans of them:
    the scheduler's and the worst of a few hundred random ones."""
    peers, records, rows = measured_world(PEERS)
    trainers, spares = trainers_and_spares(cluster_order(records), TRAIN)
    cluster = build_cluster(trainers, records, rows, EmulationSettings())
    workload = workload_for(cluster, trainers)
    best = make_plan(cluster, workload, 2, PlanConfig())
    objective = make_objective("dtfm", cluster, workload, 2)
    rng = np.random.default_rng(0)
    orders = [rng.permutation(len(trainers)).reshape(-1, 2) for _ in range(300)]
    worst = max(orders, key=lambda o: objective.evaluate(o).cost_s)
    plans = {"best": PlanRecord.from_plan_json(0, trainers + spares, best),
             "worst": PlanRecord.from_plan_json(0, trainers + spares, {
                 "stages": 2, "replicas": len(worst), "pipelines": worst.tolist(),
                 "cost_s": objective.evaluate(worst).cost_s})}
    return peers, records, rows, plans


def workload_for(cluster, trainers, peers=None, train=None):
    return run_workload(TRAIN, 2, len(trainers) // 2)


def saying(plan: PlanRecord, digest: bytes | None = None, epoch: int | None = None) -> ProgressRecord:
    """What a member that took ``plan`` up says (``epoch.run_epoch``)."""
    return ProgressRecord(plan.epoch if epoch is None else epoch, plan.start_step, None, 0.0, leader=plan.leader,
                          plan=plan.digest() if digest is None else digest)


def test_the_checkers_are_fixed_by_the_run_and_the_leader_never_the_leader_and_all_in_a_small_run():
    members = sorted(generate_identity().peer_id for _ in range(12))
    leader = members[0]
    chosen = checkers(members, leader, "run", 4)
    assert len(chosen) == 4 and leader not in chosen and chosen <= set(members)
    assert checkers(list(reversed(members)), leader, "run", 4) == chosen  # not the order they are listed in
    others = [checkers(members, leader, f"run{k}", 4) for k in range(8)]
    assert len(set(others)) > 1  # another run, other checkers (a hash, not the lowest IDs)
    assert len({checkers(members, m, "run", 4) - {leader} for m in members[1:4]}) > 1  # another leader, others
    assert checkers(members[:5], leader, "run", 4) == frozenset(members[1:5])  # at most count + 1 members: all
    assert checkers(members, leader, "run", 0) == frozenset(members[1:])  # 0: every follower checks


def test_a_plan_is_vouched_for_once_every_checker_names_it_and_not_when_one_names_another(world):
    peers, _, _, plans = world
    plan, other = plans["best"], plans["worst"]
    chosen = checkers(peers, plan.leader, "run", 3)
    progress = {c: saying(plan) for c in chosen}
    assert vouched(plan, progress, chosen) is True
    first, *_ = sorted(chosen)
    assert vouched(plan, {**progress, first: ProgressRecord(0, 0, None, 0.0)}, chosen) is None  # has not said
    assert vouched(plan, {c: r for c, r in progress.items() if c != first}, chosen) is None  # no record at all
    assert vouched(plan, {**progress, first: saying(plan, epoch=1)}, chosen) is None  # another epoch's: not this one
    assert vouched(plan, {**progress, first: saying(plan, digest=other.digest())}, chosen) is False  # shown another
    assert plan.digest() != other.digest() and len(plan.digest()) == 16


def test_a_progress_record_names_a_plan_by_its_digest_and_nothing_else(world):
    _, _, _, plans = world
    plan = plans["best"]
    record = saying(plan)
    assert decode_record(RecordKind.PROGRESS, record.encode()).plan == plan.digest()
    assert decode_record(RecordKind.PROGRESS, ProgressRecord(0, 1, 1.0, 0.1).encode()).plan == b""  # additive
    for bad in (dict(plan=b"\x01" * 5, leader=plan.leader), dict(plan=plan.digest()), dict(plan="digest", leader=plan.leader)):
        with pytest.raises(RecordError):
            ProgressRecord(0, 0, None, 0.0, **bad)


def gate_of(me, rows, clock, progress, checks, budget_s=30.0, count=3, refusals=None, statuses=None):
    def read_rows():
        checks.append(me)  # our own check reads the rows: a search of ours
        return rows

    return PlanGate(me, TRAIN, PlanConfig(verify_slack_s=0.0, checkers=count, time_budget_s=budget_s),
                    EmulationSettings(), LeaderWatch(10.0, 60.0, clock=clock), settle_s=5.0, read_rows=read_rows,
                    workload_for=workload_for, run="run", vouchers=lambda: (progress, 2.0),
                    statuses=lambda: {**(statuses or {}), **{p: PeerStatus(refused=e) for p, e in (refusals or {}).items()}})


def test_a_member_that_is_no_checker_follows_on_its_checkers_word_and_checks_itself_without_it(world):
    peers, records, rows, plans = world
    plan, bad = plans["best"], plans["worst"]
    chosen = checkers(plan.membership, plan.leader, "run", 3)
    me = next(p for p in peers if p not in chosen and p != plan.leader)
    clock, progress, checks = Clock(), {}, []
    known = {p: 60.0 for p in peers}.__getitem__
    gate = gate_of(me, rows, clock, progress, checks)
    assert not gate.accept(plan, records, known, first=True) and not checks  # waiting for its checkers' word
    assert gate.awaits_word(plan)  # taking it up meanwhile (``Following._taking_up``)
    progress.update({c: saying(plan) for c in sorted(chosen)[:2]})
    clock.now += 10
    assert not gate.accept(plan, records, known, first=True) and not checks  # two of three said so
    progress[sorted(chosen)[2]] = saying(plan)
    assert gate.accept(plan, records, known, first=True) and not checks  # all three: followed, no search of ours
    # no search of ours timed the leader's: it gets the whole budget; a trainer may take the plan up as much later
    # than us as we waited, two reads of the progress records and the control plane's pace
    assert gate.check_of(plan) == (10.0, True) and not gate.awaits_word(plan)
    assert gate.lag_s(plan) == 10.0 + 2 * 2.0 + gate.leaders.grace_s and gate.lag_s(plan, 1.5) == 1.5 + 4.0 + gate.leaders.grace_s

    # the worst plan: its checkers do not say they train it; past the budget we check it, and refuse it
    gate = gate_of(me, rows, clock, {}, checks)
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 29
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 1
    assert not gate.accept(bad, records, known, first=True) and checks == [me] and gate.refused(bad)

    # past the budget, while a checker's heartbeat answers say it still takes the plan's epoch up (its search of it
    # runs), we wait on, up to CHECKING_WAIT times the budget: the checkers' searches outlasted the budget on a loaded
    # machine, and every other member then searched beside them (32 agents on two cores)
    taking = {sorted(chosen)[0]: PeerStatus(TAKE, bad.epoch), me: PeerStatus(TAKE, bad.epoch)}
    gate, checks[:] = gate_of(me, rows, clock, {}, checks, statuses=taking), []
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 30 * CHECKING_WAIT - 1
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 1  # the most we wait
    assert not gate.accept(bad, records, known, first=True) and checks == [me] and gate.refused(bad)
    # a checker that stops taking the epoch up gets two reads of the progress records (2 s apart here) for its word
    gate, checks[:] = gate_of(me, rows, clock, {}, checks, statuses=taking), []
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 50
    assert not gate.accept(bad, records, known, first=True) and not checks
    taking[sorted(chosen)[0]] = PeerStatus("train", bad.epoch)
    clock.now += 3.9
    assert not gate.accept(bad, records, known, first=True) and not checks
    clock.now += 0.1
    assert not gate.accept(bad, records, known, first=True) and checks == [me]
    for said in (PeerStatus(TAKE, bad.epoch + 1), PeerStatus("train", bad.epoch)):  # another epoch's, or no check
        gate, checks[:] = gate_of(me, rows, clock, {}, checks, statuses={sorted(chosen)[0]: said}), []
        assert not gate.accept(bad, records, known, first=True) and not checks
        clock.now += 30
        assert not gate.accept(bad, records, known, first=True) and checks == [me]

    # a checker names another plan of the epoch: the leader showed its checkers another one; we check at once
    gate, checks[:] = gate_of(me, rows, clock, {c: saying(bad, digest=plan.digest()) for c in chosen}, checks), []
    assert not gate.accept(bad, records, known, first=True) and checks == [me] and gate.refused(bad)


def test_a_checker_that_says_in_its_heartbeats_it_refused_the_plan_makes_the_others_check_it_at_once(world):
    peers, records, rows, plans = world
    bad = plans["worst"]
    chosen = sorted(checkers(bad.membership, bad.leader, "run", 3))
    me = next(p for p in peers if p not in chosen and p != bad.leader)
    known = {p: 60.0 for p in peers}.__getitem__
    refusals: dict[str, int] = {chosen[0]: bad.epoch - 1} if bad.epoch > 0 else {}
    refusals[me] = bad.epoch  # our own word, or a non-checker's, is nobody's verdict
    checks: list[str] = []
    gate = gate_of(me, rows, Clock(), {}, checks, refusals=refusals)
    assert not gate.accept(bad, records, known, first=True) and not checks  # no checker refused this epoch's
    refusals[chosen[1]] = bad.epoch  # what its answer to our ping says (``PeerStatus.refused``)
    assert not gate.accept(bad, records, known, first=True) and checks == [me] and gate.refused(bad)  # at once
    # a good plan a checker refused (an honest disagreement) is checked by us, and followed on our own search
    good, checks[:] = plans["best"], []
    gate = gate_of(me, rows, Clock(), {}, checks, refusals={chosen[2]: good.epoch})
    assert gate.accept(good, records, known, first=True) and checks == [me]


def test_a_ping_answer_says_the_newest_plan_its_peer_refused_and_a_forged_one_is_refused():
    from p2ptrain.net.transport.status import MAX_STATUS_BYTES, Announced, PeerStatus

    announced = Announced()
    assert b"refused" not in announced.on(PeerStatus()).encode()  # absent until a plan is refused
    announced.refused = 7
    status = announced.on(PeerStatus("take", 7))
    assert PeerStatus.decode(status.encode()).refused == 7
    longest = PeerStatus("train", 2**53, 2**53, 2**53, "Q" * 128, 2**53, 2**32 - 1, 2**53)
    assert len(longest.encode()) <= MAX_STATUS_BYTES
    for bad in (b'{"state":"idle","epoch":0,"step":0,"refused":-2}', b'{"state":"idle","epoch":0,"step":0,"refused":"7"}'):
        with pytest.raises(ValueError, match="refused"):
            PeerStatus.decode(bad)


def test_a_checker_and_a_run_without_checkers_check_every_plan_themselves(world):
    peers, records, rows, plans = world
    plan = plans["best"]
    known = {p: 60.0 for p in peers}.__getitem__
    chosen = checkers(plan.membership, plan.leader, "run", 3)
    everyone = {c: saying(plan) for c in peers}
    for me, count in ((sorted(chosen)[0], 3), (next(p for p in peers if p not in chosen and p != plan.leader), 0)):
        checks: list[str] = []
        gate = gate_of(me, rows, Clock(), everyone, checks, count=count)
        assert gate.accept(plan, records, known, first=True) and checks == [me]  # its own search, though all vouch
        assert gate.check_s(plan) > 0 and not gate.awaits_word(plan)
        # nobody follows on the word where every follower checks: a trainer's lag is our own check alone
        assert gate.lag_s(plan) == (gate.check_s(plan) if count == 0 else gate.check_s(plan) + 4.0 + gate.leaders.grace_s)


def test_a_plan_config_refuses_a_negative_count_of_checkers():
    from p2ptrain.errors import ConfigError
    with pytest.raises(ConfigError, match="plan.checkers"):
        dataclasses.replace(PlanConfig(), checkers=-1)


class _Planner:
    """The leader's planner thread as a watcher uses it: the searches submitted, none of them ending."""

    def __init__(self) -> None:
        self.submitted: list[tuple] = []

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        self.submitted.append((fn, args))
        return concurrent.futures.Future()


def test_a_member_that_is_no_checker_searches_only_once_the_leader_is_later_than_the_budget(world, monkeypatch):
    peers, records, rows, _ = world
    leader = min(peers)
    config = AgentConfig(initial_peers=(f"/ip4/127.0.0.1/tcp/31337/p2p/{leader}",), run="run", train=TRAIN,
                         membership=MembershipConfig(expect=len(peers)), plan=PlanConfig(checkers=3, time_budget_s=60.0))
    chosen = checkers(peers, leader, "run", 3)
    now = [1000.0]
    monkeypatch.setattr(watching.time, "monotonic", lambda: now[0])
    leaders = LeaderWatch(10.0, 60.0, clock=lambda: now[0])
    dht = SimpleNamespace(read_links=lambda: rows, slowest_store_s=lambda: 0.0)
    pricing = SimpleNamespace(plan_workload=lambda trainers, membership, train: workload_for(None, trainers))
    membership = Membership(records)
    statuses: dict[str, PeerStatus] = {}  # the answers to our pings: none from a checker here

    def watcher(me: str, announced: Announced | None = None) -> tuple[watching.Watching, _Planner]:
        planner = _Planner()
        return watching.Watching(config, dht, None, me, leaders, view=lambda: SimpleNamespace(statuses=statuses),
                                 started=now[0], stages=RunStages(TRAIN), planner=planner, pricing=pricing,
                                 links_wait=watching.LinksWait(), announced=announced), planner

    said = Announced()
    checker, searched = watcher(sorted(chosen)[0], said)
    assert checker._search_allowance(membership) == 60.0 + watching.PUBLISH_S and len(searched.submitted) == 1
    assert said.search == 0  # its ping answers say how long its search has run
    member, planner = watcher(next(p for p in peers if p not in chosen and p != leader))
    assert leaders.waiting(leader, True, 60.0) is None  # the plan falls due now
    for _ in range(2):  # a checker searches when the plan falls due; we do not (we follow on its checkers' word)
        assert member._search_allowance(membership) == 60.0 + watching.PUBLISH_S and not planner.submitted
        now[0] += 30.0
    # the budget passed and no plan: the leader is late, and our own search times it (its checkers' did not end)
    assert member._search_allowance(membership) == 60.0 + watching.PUBLISH_S and len(planner.submitted) == 1
    now[0] += 50.0  # while it runs: the budget and twice its time so far, so the leader is never passed over for it
    assert member._search_allowance(membership) == 60.0 + 2 * 50.0 + watching.PUBLISH_S and len(planner.submitted) == 1
    assert checker._search_allowance(membership) == 2 * 110.0 + watching.PUBLISH_S and said.search == 110


def test_a_member_that_is_no_checker_times_a_late_leader_by_what_its_checkers_say_they_search(world, monkeypatch):
    """Where the checkers' ping answers say how long their searches of the first plan run (``PeerStatus.search``),
    a member that is no checker gives a late leader twice that and makes no search of its own: 32 agents on two
    cores had 27 such members search beside a late leader. One checker that claims a day cannot hold the run."""
    peers, records, rows, _ = world
    leader = min(peers)
    config = AgentConfig(initial_peers=(f"/ip4/127.0.0.1/tcp/31337/p2p/{leader}",), run="run", train=TRAIN,
                         membership=MembershipConfig(expect=len(peers)), plan=PlanConfig(checkers=3, time_budget_s=60.0))
    chosen = sorted(checkers(peers, leader, "run", 3))
    now = [1000.0]
    monkeypatch.setattr(watching.time, "monotonic", lambda: now[0])
    leaders = LeaderWatch(10.0, 60.0, clock=lambda: now[0])
    statuses = {p: PeerStatus(search=s) for p, s in zip(chosen, (70, 90, 86_400), strict=True)}
    statuses[next(p for p in peers if p not in chosen and p != leader)] = PeerStatus(search=5_000)  # no checker
    planner = _Planner()
    me = next(p for p in sorted(peers, reverse=True) if p not in chosen and p != leader)
    member = watching.Watching(config, SimpleNamespace(read_links=lambda: rows, slowest_store_s=lambda: 0.0), None,
                               me, leaders, view=lambda: SimpleNamespace(statuses=statuses), started=now[0],
                               stages=RunStages(TRAIN), planner=planner,
                               pricing=SimpleNamespace(), links_wait=watching.LinksWait())
    membership = Membership(records)
    assert leaders.waiting(leader, True, 60.0) is None  # the plan falls due now
    assert member._search_allowance(membership) == 60.0 + watching.PUBLISH_S
    now[0] += 61.0  # the leader is late: twice the lower median the checkers say (90 s), no search of ours
    assert member._search_allowance(membership) == 2 * 90.0 + watching.PUBLISH_S and not planner.submitted
    statuses.update({p: PeerStatus(search=10) for p in chosen[:2]})  # their searches took 10 s: the budget
    assert member._search_allowance(membership) == 60.0 + watching.PUBLISH_S and not planner.submitted
    assert watching.checkers_search_s({p: PeerStatus() for p in chosen}, chosen) is None  # none says: ours (above)
