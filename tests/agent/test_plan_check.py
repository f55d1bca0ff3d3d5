"""The follower's checks of a leader's plan and its watch on the leader (``agent.plan_check``), without I/O:
a small measured world-wide network as peer and links records, plans that are fine and plans that are not."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import numpy as np
import pytest
from agent_helpers import measured_world

from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership.plan_check import (
    CulpableWatch,
    LeaderWatch,
    PlanGate,
    cost_check,
    culpable_leader,
    first_plan_problem,
    halts_settled,
    membership_problem,
    newer_plan_excuses,
    rows_as_planned,
)
from p2ptrain.agent.leadership.plan_maker import build_cluster, make_plan, run_workload
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.planning import make_objective
from p2ptrain.planning.scenarios import scenario
from p2ptrain.runtime.config import TrainConfig

TRAIN = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
NO_EMULATION = EmulationSettings()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def world():
    return measured_world()


def plan_record(peers: list[str], trainers: list[str], order: tuple[int, ...]) -> PlanRecord:
    """A 2-stage plan of ``trainers`` (in ``order``) with every other peer a spare."""
    devices = trainers + [p for p in peers if p not in trainers]
    plan = {"stages": 2, "replicas": len(trainers) // 2, "pipelines": np.array(order).reshape(-1, 2).tolist(),
            "cost_s": 1.0}
    return PlanRecord.from_plan_json(0, devices, plan)


def workload_for(cluster, trainers, peers=None, train=None):
    return run_workload(TRAIN, 2, len(trainers) // 2)


def scored(peers, records, rows, trainers):
    cluster = build_cluster(trainers, records, rows, NO_EMULATION)
    objective = make_objective("dtfm", cluster, workload_for(cluster, trainers), 2)
    costs = {p: objective.evaluate(np.array(p).reshape(-1, 2)).cost_s for p in itertools.permutations(range(4))}
    return min(costs, key=costs.get), max(costs, key=costs.get), costs


def test_the_best_plan_passes_and_the_worst_is_refused_with_both_costs(world):
    peers, records, rows = world
    trainers = peers[:4]
    best, worst, costs = scored(peers, records, rows, trainers)
    assert costs[worst] > 1.1 * costs[best]  # the network makes the order matter

    good = cost_check(plan_record(peers, trainers, best), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                      workload_for, 0.1)
    assert good.problem is None
    assert good.theirs_s == pytest.approx(costs[best]) and good.ours_s <= costs[best] + 1e-9

    bad = cost_check(plan_record(peers, trainers, worst), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                     workload_for, 0.1)
    assert bad.theirs_s == pytest.approx(costs[worst])
    assert bad.problem is not None and "our own plan of the same records predicts" in bad.problem
    # the tolerance is the line: the same plan passes when allowed to be that much slower
    lenient = cost_check(plan_record(peers, trainers, worst), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                         workload_for, costs[worst] / bad.ours_s - 1 + 1e-6)
    assert lenient.problem is None
    # ... and so is the slack: a difference of a few milliseconds (noise on short steps) is no reason
    slack = cost_check(plan_record(peers, trainers, worst), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                       workload_for, 0.0, costs[worst] - bad.ours_s + 1e-6)
    assert slack.problem is None


def test_a_plan_that_trains_the_wrong_peers_or_stages_is_refused(world):
    peers, records, rows = world
    with pytest.raises(ValueError, match="the run's settings train 4 of 5"):
        cost_check(plan_record(peers, peers[:2], (0, 1)), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                   workload_for, 0.1)
    one_stage = PlanRecord(epoch=0, membership=tuple(peers), stages=1, replicas=4, pipelines=((0,), (1,), (2,), (3,)),
                           cost_s=1.0)
    with pytest.raises(ValueError, match="it has 1 stages; the run trains 2"):
        cost_check(one_stage, records, rows, TRAIN, PlanConfig(), NO_EMULATION, workload_for, 0.1)


def test_a_plan_from_a_slow_trainer_choice_is_scored_on_its_own_trainers(world):
    """A leader that trains the spare (Seoul) instead of a better-placed peer is scored on what it chose."""
    peers, records, rows = world
    ours = make_plan(build_cluster(peers[:4], records, rows, NO_EMULATION), workload_for(None, peers[:4]), 2,
                     PlanConfig())["cost_s"]
    theirs = [peers[0], peers[1], peers[2], peers[4]]
    best, _, costs = scored(peers, records, rows, theirs)
    check = cost_check(plan_record(peers, theirs, best), records, rows, TRAIN, PlanConfig(), NO_EMULATION,
                       workload_for, 0.1)
    assert check.theirs_s == pytest.approx(costs[best]) and check.ours_s == pytest.approx(ours)


def test_membership_problems():
    a, b, c, d = sorted(generate_identity().peer_id for _ in range(4))
    plan = PlanRecord(epoch=0, membership=(a, b, c), stages=1, replicas=2, pipelines=((0,), (1,)), cost_s=1.0)
    assert membership_problem(plan, {a, b, c}, {a, b, c}, first=True) is None
    assert "names 1 peer(s) we do not see live" in membership_problem(plan, {a, b}, {a, b}, first=False)
    assert "leaves out 1 live peer(s)" in membership_problem(plan, {a, b, c, d}, {a, b, c, d}, first=True)
    assert membership_problem(plan, {a, b, c, d}, {a, b, c}, first=True) is None  # d is new: the leader may not know it
    assert membership_problem(plan, {a, b, c, d}, {a, b, c, d}, first=False) is None  # a later plan may leave d out


def test_leader_watch_passes_over_after_grace_and_backs_off_doubling():
    clock = Clock()
    watch = LeaderWatch(grace_s=10.0, backoff_s=60.0, clock=clock)
    assert watch.waiting("L", due=False) is None
    clock.now += 100
    assert watch.waiting("L", due=True, allowance_s=5.0) is None  # the clock starts when the plan is due
    clock.now += 15
    assert watch.waiting("L", due=True, allowance_s=5.0) is None  # exactly grace + allowance: not yet
    clock.now += 0.1
    assert watch.waiting("L", due=True, allowance_s=5.0) == "L"
    assert watch.pass_over("L") == 60.0 and watch.excluded() == {"L"}

    assert watch.waiting("M", due=True) is None
    clock.now += 8
    watch.satisfied()  # a plan came: the clock stops
    assert watch.waiting("M", due=True) is None
    clock.now += 8
    assert watch.waiting("N", due=True) is None  # another leader: its own clock
    clock.now += 8
    assert watch.waiting("N", due=True) is None
    clock.now += 3
    assert watch.waiting("N", due=True) == "N"

    clock.now += 53  # L's back-off ends; passed over again, it waits twice as long
    assert watch.excluded() == set()
    assert watch.pass_over("L") == 120.0
    clock.now += 119
    assert "L" in watch.excluded()
    clock.now += 2
    assert "L" not in watch.excluded()


def test_a_leaders_grace_follows_the_control_planes_pace():
    clock = Clock()
    watch = LeaderWatch(grace_s=10.0, backoff_s=60.0, clock=clock, poll_s=0.5)
    assert watch.grace_s == 10.0  # nothing read yet: the configured most
    for seconds in (0.05, 0.1, 0.08):
        watch.observe_read(seconds)
    assert watch.grace_s == 2.0  # two polls and a second: fast reads
    watch.observe_read(1.5)  # a loaded DHT: four of the slowest read
    assert watch.grace_s == 6.0
    watch.observe_read(9.0)
    assert watch.grace_s == 10.0  # never past [membership] leader_grace_s
    assert LeaderWatch(grace_s=10.0, backoff_s=60.0).grace_s == 10.0  # without a poll: fixed
    # the due clock: when a plan fell due under a leader
    assert watch.due_since("a", 5.0) == 5.0
    clock.now = 3.0
    assert watch.waiting("a", True, 1.0) is None and watch.due_since("a", 9.0) == 3.0 and watch.due_since("b", 9.0) == 9.0


def test_the_next_leader_gets_the_time_it_needs_to_pass_its_predecessor_over_itself():
    """Our grace is paced by our reads (2 s here); the successor's by its own, up to ``leader_grace_s`` (10 s):
    it knows it leads only after that. So a leader that succeeds one we passed over a moment ago gets the
    difference on top (a follower with fast reads passed the next leader over as it published, under CI load)."""
    clock = Clock()
    watch = LeaderWatch(grace_s=10.0, backoff_s=60.0, clock=clock, poll_s=0.5)
    watch.observe_read(0.05)
    assert watch.grace_s == 2.0
    start = clock.now
    assert watch.waiting("a", True, 1.0) is None
    clock.now = start + 3.5
    assert watch.waiting("a", True, 1.0) == "a"  # 2 s of grace and 1 s of allowance: out of time
    watch.pass_over("a")
    assert watch.waiting("b", True, 1.0) is None  # its clock starts ...
    clock.now = start + 3.5 + 11.0
    assert watch.waiting("b", True, 1.0) is None  # ... and runs 8 s longer than ours would (3 s)
    clock.now = start + 3.5 + 11.1
    assert watch.waiting("b", True, 1.0) == "b"
    # a leader that fell due long after our last pass-over gets our grace alone
    clock.now = start + 100.0
    assert watch.waiting("c", True, 1.0) is None
    clock.now = start + 103.5
    assert watch.waiting("c", True, 1.0) == "c"


def test_a_replan_is_due_once_every_live_trainer_halted_and_nothing_is_judged(world):
    from p2ptrain.verify.evidence import DisputeHeader

    peers, _, _ = world
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))
    halted = lambda epoch=0: ProgressRecord(epoch, 2, None, 0.0, halted=True)  # noqa: E731
    live = peers[:4]
    every = {p: halted() for p in live}
    assert halts_settled(plan, live, every, steps=6)
    assert not halts_settled(plan, live, {**every, peers[3]: ProgressRecord(0, 3, None, 0.1)}, steps=6)  # trains on
    assert halts_settled(plan, live, {**every, peers[3]: ProgressRecord(0, 6, None, 0.1)}, steps=6)  # done
    assert not halts_settled(plan, live, {**every, peers[3]: halted(epoch=1)}, steps=6)  # another epoch's
    assert halts_settled(plan, live[:3], {p: every[p] for p in live[:3]}, steps=6)  # a dead trainer is not waited for
    header = DisputeHeader(0, 2, 0, 0, peers[1], 2, 9.9, 1000, "0" * 64).to_bytes()
    judged = dataclasses.replace(halted(), blame=peers[1], evidence=header, refused=True)
    assert not halts_settled(plan, live, {**every, peers[0]: judged}, steps=6)  # the leader judges a recompute


def test_only_the_leaders_own_newer_plan_stops_its_clock():
    # peers in ID order: a was passed over by everyone, b is silent, c passed b over a moment before we did
    a, b, c, d = sorted(generate_identity().peer_id for _ in range(4))

    def plan(epoch: int, signer: str) -> PlanRecord:
        # the signer is the plan's first member (``PlanRecord.leader``: each plan is signed by the leader it names)
        return PlanRecord(epoch=epoch, membership=(signer, d), stages=1, replicas=2, pipelines=((0,), (1,)),
                          cost_s=1.0)

    live = [b, c, d]
    assert not newer_plan_excuses(None, -1, b, live)
    assert newer_plan_excuses(plan(1, b), -1, b, live)  # our leader planned, without us: wait for a re-plan point
    assert newer_plan_excuses(plan(1, a), -1, b, live)  # signed by a peer no longer live (a leader that died)
    # signed by c, ranked after our leader: the others passed b over; b still owes us a plan (CI once saw
    # an agent wait on b for ever while c's swarm waited on it)
    assert not newer_plan_excuses(plan(1, c), -1, b, live)
    assert not newer_plan_excuses(plan(1, b), 1, b, live)  # the plan we follow is no newer plan


def test_gate_waits_for_unseen_members_then_refuses_once_and_skips_our_own(world, caplog):
    peers, records, rows = world
    me, clock = peers[3], Clock()
    refusals, passed = [], []
    gate = PlanGate(me, TRAIN, PlanConfig(verify_slack_s=0.0), NO_EMULATION, LeaderWatch(10.0, 60.0, clock=clock),
                    settle_s=5.0,
                    read_rows=lambda: rows, workload_for=workload_for,
                    on_refusal=lambda plan, reason: refusals.append(reason),
                    pass_over=lambda leader, why: passed.append(leader))
    best, worst, _ = scored(peers, records, rows, peers[:4])
    live = {p: records[p] for p in peers[:4]}  # the spare peers[4] not seen yet
    known = {p: 60.0 for p in peers}.__getitem__
    plan = plan_record(peers, peers[:4], best)
    assert not gate.accept(plan, live, known, first=True) and not refusals and not passed  # our view may lag: wait
    clock.now += 6
    assert not gate.accept(plan, live, known, first=True)
    assert len(refusals) == 1 and "we do not see live" in refusals[0]
    assert passed == [plan.leader]  # a refusal passes the leader over at once, not after the grace
    assert gate.accept(plan, records, known, first=True)  # now we see it
    assert gate.check_s(plan) > 0  # our own search of its records took this long (the trainers' no-show window)

    bad = plan_record(peers, peers[:4], worst)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert not gate.accept(bad, records, known, first=True)
        assert not gate.accept(bad, records, known, first=True)
    assert gate.refused(bad) and not gate.refused(plan)
    assert len(refusals) == 2 and sum("it predicts" in r.message for r in caplog.records) == 1
    assert passed == [plan.leader] * 3  # logged once; passed over each time it is met as the leader again

    off = PlanGate(me, TRAIN, PlanConfig(verify=False), NO_EMULATION, LeaderWatch(10.0, 60.0, clock=clock), 5.0,
                   lambda: rows, workload_for)
    assert off.accept(bad, records, known, first=True)  # checks off: the leader's word is taken


def test_gate_takes_our_own_plan_unchecked(world):
    peers, records, rows = world
    _, worst, _ = scored(peers, records, rows, peers[:4])
    bad = plan_record(peers, peers[:4], worst)
    gate = PlanGate(bad.leader, TRAIN, PlanConfig(), NO_EMULATION, LeaderWatch(10.0, 60.0), 5.0,
                    lambda: pytest.fail("our own plan is not checked"), workload_for)
    assert gate.accept(bad, records, lambda p: 60.0, first=True)


def test_the_runs_first_plan_may_not_leave_out_peers_an_honest_leader_would_plan(world):
    peers, records, rows = world
    two = PlanRecord.from_plan_json(0, peers[:2], {"stages": 2, "replicas": 1, "pipelines": [[0, 1]], "cost_s": 1.0})
    # the run waits for 4: a first plan of 2 while 5 are live leaves out peers an honest leader planned
    assert first_plan_problem(two, peers, [], needed=4) == "it plans 2 members where the run waits for 4 and we see 5 live"
    assert first_plan_problem(two, peers[:2], [], needed=4) is None  # only 2 live: an honest leader plans them
    assert first_plan_problem(two, peers, peers[:3], needed=2) == f"it leaves out 1 live peer(s) ({peers[2]})"
    assert first_plan_problem(two, peers, peers[:2], needed=2) is None

    # a follower it leaves out: refused, and its leader passed over at once, if nothing was trained yet
    clock, passed, refusals = Clock(), [], []
    gate = PlanGate(peers[4], TRAIN, PlanConfig(), NO_EMULATION, LeaderWatch(10.0, 60.0, clock=clock), 5.0,
                    lambda: rows, workload_for, lambda plan, reason: refusals.append(reason),
                    lambda leader, why: passed.append(leader), needed=4)
    known = {p: 60.0 for p in peers}.__getitem__
    assert not gate.left_out(two, peers, known, untrained=lambda: False)  # a run that trained: we wait as joiners do
    assert not passed and not gate.left_out(dataclasses.replace(two, start_step=3), peers, known, lambda: True)
    assert gate.left_out(two, peers, known, untrained=lambda: True) and gate.refused(two)
    assert passed == [two.leader] and refusals == ["it plans 2 members where the run waits for 4 and we see 5 live"]


def test_a_leader_whose_own_stage_failed_its_epoch_is_culpable(world):
    peers, _, _ = world
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # signed by peers[0], which holds stage 0 of pipeline 0
    halted = lambda blame=None, epoch=0: ProgressRecord(epoch, 0, None, 0.0, halted=True, blame=blame)  # noqa: E731
    assert culpable_leader(plan, {}, 60.0) is None
    # its stage-1 trainer timed out on its activations, its stage-0 replica on its gradient shard
    blames = {peers[1]: halted(peers[0]), peers[2]: halted(peers[0])}
    assert culpable_leader(plan, blames, 5.0) is None  # not halted yet: it may still say whom it waited on
    why = "epoch 0, which it planned, failed at its own stage (the failed calls of 2 trainer(s) blame it)"
    assert culpable_leader(plan, blames, 10.0) == why  # ... for BLAMED_HALT_S
    assert culpable_leader(plan, {**blames, peers[0]: halted()}, 0.0) == why  # halted, blaming nobody: at once
    # a cascade that ends elsewhere: a victim that blamed the leader, which blamed the real end
    assert culpable_leader(plan, {peers[1]: halted(peers[0]), peers[0]: halted(peers[3])}, 60.0) is None
    assert culpable_leader(plan, {peers[1]: halted(peers[0], epoch=1)}, 60.0) is None  # another epoch's
    assert culpable_leader(plan, {generate_identity().peer_id: halted(peers[0])}, 60.0) is None  # not a member

    clock, reads = Clock(), []
    watch = CulpableWatch(1.0, clock=clock)
    read = lambda: reads.append(1) or blames  # noqa: E731
    assert watch.check(plan, read) is None and watch.check(plan, read) is None and len(reads) == 1  # throttled
    clock.now += 10.0
    assert watch.check(plan, read) == why and len(reads) == 2  # 10 s since it was first blamed


def test_a_member_the_leader_refused_cannot_get_it_passed_over():
    """The leader's own check found a member's work wrong (its halted record refuses it): the member's blame of
    the leader, a failed call or a refusal of its own, is its word against the leader's and passes no leader over;
    without the leader's refusal the same blame still does."""
    peers = sorted(generate_identity().peer_id for _ in range(5))
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # led by peers[0]
    leader_refused = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[1], refused=True)
    call = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[0])
    counter = dataclasses.replace(call, refused=True)  # it says a check of its own found the leader wrong
    for blame in (call, counter):
        assert culpable_leader(plan, {peers[0]: leader_refused, peers[1]: blame}, 60.0, run="r") is None
        assert culpable_leader(plan, {peers[0]: leader_refused, peers[1]: blame}, 60.0) is None
    # the leader halted on a failed call of its own (no refusal): a refusal of it names it, as before
    leader_call = dataclasses.replace(leader_refused, refused=False)
    assert culpable_leader(plan, {peers[0]: leader_call, peers[1]: counter}, 60.0) is not None
    # and a third trainer's refusal of the leader still counts, whatever the leader says of another
    third = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[0], refused=True)
    assert culpable_leader(plan, {peers[0]: leader_refused, peers[1]: counter, peers[2]: third}, 60.0) is not None


def test_a_member_another_member_refused_cannot_get_the_leader_passed_over():
    """A non-leader's check refuses a member (issue 45's campaign: ``accuse_back @ finder``); the refused member
    blames the leader, with a refusal or a failed call of its own: contested, no leader is passed over. The
    finder's refusal still names the member, and two members refusing each other stay word against word."""
    peers = sorted(generate_identity().peer_id for _ in range(5))
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # led by peers[0]
    finder = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[3], refused=True)
    leader = ProgressRecord(0, 2, None, 0.0, halted=True)  # aborted, blaming nobody
    call = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[0])
    for blame in (call, dataclasses.replace(call, refused=True)):
        records = {peers[2]: finder, peers[3]: blame, peers[0]: leader}
        assert culpable_leader(plan, records, 60.0) is None
        assert culpable_leader(plan, {peers[3]: blame, peers[0]: leader}, 60.0) is not None  # uncontested: it counts
    # two corrupt members of the leader's group both blame it: its record refuses one and names the other too
    both = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[1], refused=True, also=(peers[2],))
    accusing = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[0], refused=True)
    assert culpable_leader(plan, {peers[0]: both, peers[1]: accusing, peers[2]: accusing}, 60.0) is None
    assert culpable_leader(plan, {peers[0]: dataclasses.replace(both, also=()), peers[1]: accusing,
                                  peers[2]: accusing}, 60.0) is not None
    # an honest third trainer's blame of the leader is no one's contested word
    third = ProgressRecord(0, 2, None, 0.0, halted=True, blame=peers[0])
    assert culpable_leader(plan, {peers[2]: finder, peers[3]: call, peers[1]: third, peers[0]: leader}, 60.0) \
        is not None


def test_the_blames_of_a_member_proven_by_evidence_are_void():
    ids = sorted((generate_identity() for _ in range(5)), key=lambda i: i.peer_id)
    peers = [i.peer_id for i in ids]
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # led by peers[0]
    run = "proven"
    proof = _statement(ids[3].private_key, peers[3], run, adds_up=False)  # peers[3]'s own sums do not add up
    finder = ProgressRecord(0, 3, None, 0.0, halted=True, blame=peers[3], evidence=proof, refused=True)
    accuses_leader = ProgressRecord(0, 3, None, 0.0, halted=True, blame=peers[0], refused=True)
    leader_halted = ProgressRecord(0, 3, None, 0.0, halted=True)
    records = {peers[2]: finder, peers[3]: accuses_leader, peers[0]: leader_halted}
    assert culpable_leader(plan, records, 60.0, run=run) is None  # judged: the proven culprit's word is void
    assert culpable_leader(plan, records, 60.0) is None  # unjudged, its finder's refusal still contests it
    waited = dataclasses.replace(finder, evidence=b"", refused=False)  # a failed call on it: no one contests it
    assert culpable_leader(plan, {**records, peers[2]: waited}, 60.0) is not None  # its refusal names the leader


def _statement(key, member: str, run: str, adds_up: bool) -> bytes:
    """A signed one-bucket ``sketch`` statement whose attested numbers add up or not (``verify.sum_check``)."""
    import torch

    from p2ptrain.verify import statement
    from p2ptrain.verify.attest import statement_header

    rows, n = 32, 2
    added = [torch.randn(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(j)) for j in range(n)]
    total = sum(added) * (1.0 if adds_up else 8.0)
    values = [total, torch.tensor([1.0, 0.0], dtype=torch.float64)]
    for a in added:
        values += [a, torch.tensor([1.0], dtype=torch.float64)]
    body = statement_header("sketch", run, 0, 3, 0, member, 0, n, [100], rows, 7) + torch.cat(values).numpy().tobytes()
    return statement.sign(key, body)


def test_a_blame_with_evidence_is_judged_before_it_passes_a_leader_over():
    ids = sorted((generate_identity() for _ in range(5)), key=lambda i: i.peer_id)
    peers = [i.peer_id for i in ids]
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # led by peers[0]
    run = "judged"
    forged = ProgressRecord(0, 3, None, 0.0, halted=True, blame=peers[0],
                            evidence=_statement(ids[0].private_key, peers[0], run, adds_up=True))
    leader_halted = ProgressRecord(0, 3, None, 0.0, halted=True)  # blaming nobody: the root of any blame
    # without judging, one blame ends at a leader that halted: passed over; judged, a liar's blame is nothing
    assert culpable_leader(plan, {peers[1]: forged, peers[0]: leader_halted}, 60.0) is not None
    assert culpable_leader(plan, {peers[1]: forged, peers[0]: leader_halted}, 60.0, run=run) is None
    tampered = dataclasses.replace(forged, evidence=forged.evidence[:-5] + b"AAAA=")
    assert culpable_leader(plan, {peers[1]: tampered, peers[0]: leader_halted}, 60.0, run=run) is None
    # a proven failure of its own work: at once, halted or not
    proven = dataclasses.replace(forged, evidence=_statement(ids[0].private_key, peers[0], run, adds_up=False))
    why = culpable_leader(plan, {peers[1]: proven}, 0.0, run=run)
    assert why is not None and "its own work failed a check" in why
    watch = CulpableWatch(0.0, run=run)
    assert watch.check(plan, lambda: {peers[1]: forged, peers[0]: leader_halted}) is None


def test_a_failed_recomputes_blame_of_the_leader_is_no_blame_to_followers_and_of_others_their_finders_word():
    """Its evidence's bulk goes to the leader, which judges it (``verify.dispute``): a follower cannot, so a liar's
    recompute blame must not pass an honest leader over; a recompute blame of another member counts as before."""
    from p2ptrain.verify.evidence import DisputeHeader

    peers = sorted(generate_identity().peer_id for _ in range(5))
    plan = plan_record(peers, peers[:4], (0, 1, 2, 3))  # led by peers[0]
    header = DisputeHeader(0, 3, 0, 0, peers[0], 2, 9.9, 1000, "0" * 64).to_bytes()
    blame = ProgressRecord(0, 3, None, 0.0, halted=True, blame=peers[0], evidence=header)
    leader_halted = ProgressRecord(0, 3, None, 0.0, halted=True)
    assert culpable_leader(plan, {peers[1]: blame, peers[0]: leader_halted}, 60.0, run="r") is None
    word = ProgressRecord(0, 3, None, 0.0, halted=True, blame=peers[0])  # the same blame without evidence: counted
    assert culpable_leader(plan, {peers[1]: word, peers[0]: leader_halted}, 60.0, run="r") is not None
    # of another member: its finder's word, as any blame (an edge in blame_roots, here away from the leader)
    other = dataclasses.replace(blame, blame=peers[2], evidence=DisputeHeader(0, 3, 0, 1, peers[2], 2, 9.9, 1000,
                                                                              "0" * 64).to_bytes())
    assert culpable_leader(plan, {peers[1]: other, peers[0]: ProgressRecord(0, 3, None, 0.0, halted=True,
                                                                            blame=peers[1])}, 60.0, run="r") is None


def test_a_follower_searches_the_same_records_once(world, monkeypatch):
    """Its own search of the first plan and its check of the leader's plan of the same records are one search
    (``searches._searched``); other records are searched afresh."""

    from p2ptrain.agent.leadership import searches

    peers, records, rows = world
    calls = []
    real = searches.schedule
    monkeypatch.setattr(searches, "schedule", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(searches, "_searched", type(searches._searched)())
    cluster = build_cluster(peers[:4], records, rows, NO_EMULATION)
    first = make_plan(cluster, workload_for(None, peers[:4]), 2, PlanConfig())
    again = make_plan(build_cluster(peers[:4], records, rows, NO_EMULATION), workload_for(None, peers[:4]), 2, PlanConfig())
    assert again == first and len(calls) == 1
    again["cost_s"] = -1.0  # a caller's copy: the kept search is untouched
    assert make_plan(cluster, workload_for(None, peers[:4]), 2, PlanConfig())["cost_s"] == first["cost_s"]
    other = build_cluster([peers[0], peers[1], peers[2], peers[4]], records, rows, NO_EMULATION)
    make_plan(other, workload_for(None, peers[:4]), 2, PlanConfig())
    assert len(calls) == 2


def test_a_followers_check_is_the_leaders_search_stopped_at_its_evaluations(monkeypatch):
    """The check's search stops after ``plan.verify_device_evaluations`` over the devices (0: never), says so, and an
    honest leader's plan of the full search passes it; a search stopped there gives the leader's all its budget."""
    from p2ptrain.agent.leadership import searches
    from p2ptrain.agent.leadership.watching import search_allowance
    from p2ptrain.planning.search import DEFAULT_SEARCH

    peers = sorted(generate_identity().peer_id for _ in range(16))
    net = scenario("worldwide", 16)
    records = {p: PeerRecord(device_name=f"dev{k}", memory_gb=16.0, tflops=10.0) for k, p in enumerate(peers)}
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(float(net.latency_ms[i, j]), float(net.bandwidth_gbps[i, j]))
                                       for j, b in enumerate(peers) if j != i}) for i, a in enumerate(peers)}
    train = dataclasses.replace(TRAIN, stages=4)

    def workload(cluster, trainers, peers=None, train=None):
        return run_workload(TRAIN, 4, len(trainers) // 4)

    cluster = build_cluster(peers, records, rows, NO_EMULATION)
    leader = make_plan(cluster, workload(cluster, peers), 4, PlanConfig())  # the leader searches in full
    assert leader["search"]["stopped_by"] == "converged" and leader["search"]["evaluations"] > 600
    assert "random" in leader["baselines"]
    record = PlanRecord.from_plan_json(0, peers, leader)
    configs = []
    real = searches.schedule
    monkeypatch.setattr(searches, "schedule", lambda *a, **k: configs.append(k) or real(*a, **k))
    check = cost_check(record, records, rows, train, PlanConfig(verify_device_evaluations=16 * 200), NO_EMULATION,
                       workload, 0.1)
    assert configs[-1]["config"].max_evaluations == 200 and configs[-1]["random_samples"] == 0
    assert check.stopped_short and check.problem is None and check.theirs_s <= check.ours_s * 1.1
    default = cost_check(record, records, rows, train, PlanConfig(), NO_EMULATION, workload, 0.1)
    assert configs[-1]["config"].max_evaluations == PlanConfig().verify_device_evaluations // 16
    assert default.problem is None and not default.stopped_short  # a small run: the leader's search, converged
    assert cost_check(record, records, rows, train, PlanConfig(verify_device_evaluations=0), NO_EMULATION, workload,
                      0.1).problem is None
    assert configs[-1]["config"] == DEFAULT_SEARCH

    # a leader's search may take twice ours (the same search first, bounded by evaluations, not time: beyond the
    # budget on a loaded machine), at least the budget where ours stopped short (its full search goes on), then publish
    assert search_allowance(2.0, False, 60.0) == 5.0
    assert search_allowance(40.0, False, 60.0) == 81.0
    assert search_allowance(300.0, False, 60.0) == 601.0
    assert search_allowance(0.5, True, 60.0) == 61.0
    assert search_allowance(300.0, True, 60.0) == 601.0
    assert search_allowance(40.0, False, 60.0, publish_s=21.0) == 101.0  # our own stores take 10 s lately


def test_the_first_plan_is_checked_on_the_rows_read_when_it_fell_due(world):
    """A plan's neighbours measure each other once it is out, and a busy run's followers check it minutes later:
    scored on links the leader never saw, an honest first plan was refused (32 agents, session 43). So a follower
    checks the first plan of the members its own search planned on the rows that search read
    (``Watching.rows_to_check``); a re-plan, or a plan of other members, on the rows read afresh."""
    from p2ptrain.agent.leadership.watching import Watching

    peers, records, rows = world
    _, worst, _ = scored(peers, records, rows, peers[:4])
    plan = plan_record(peers, peers[:4], worst)  # the worst on ``rows``; on the rows as read before, no worse
    before = {a: LinksRecord.from_peers({b: LinkMeasurement(10.0, 1.0) for b in peers if b != a}) for a in peers}

    def gate(rows_for):
        return PlanGate(peers[4], TRAIN, PlanConfig(verify_slack_s=0.0), NO_EMULATION, LeaderWatch(10.0, 60.0), 0.0,
                        lambda: rows, workload_for, rows_for=rows_for)

    watching = Watching.__new__(Watching)  # its rows as its own search of the first plan read them
    watching._own_rows = (frozenset(peers), before)
    assert watching.rows_to_check(plan) is before
    assert gate(watching.rows_to_check).accept(plan, records, lambda p: 60.0, first=True)
    assert not gate(lambda p: None).accept(plan, records, lambda p: 60.0, first=True)  # on the rows read now
    assert watching.rows_to_check(dataclasses.replace(plan, start_step=3)) is None  # a re-plan: read afresh
    watching._own_rows = (frozenset(peers[:4]), before)
    assert watching.rows_to_check(plan) is None  # our search planned other members


def test_a_leaders_plan_is_never_worse_than_the_check_its_followers_make_however_loaded(monkeypatch):
    """The check's search is bounded by evaluations, not time; the leader makes that very search first, whatever its
    time budget (a loaded machine's leader, stopped by time, was refused by followers whose check went further),
    then the full search in what is left of its budget where the check's stopped at its cap."""
    from p2ptrain.agent.leadership import searches

    monkeypatch.setattr(searches, "_searched", type(searches._searched)())
    peers = sorted(generate_identity().peer_id for _ in range(16))
    net = scenario("worldwide", 16)
    records = {p: PeerRecord(device_name=f"dev{k}", memory_gb=16.0, tflops=10.0) for k, p in enumerate(peers)}
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(float(net.latency_ms[i, j]), float(net.bandwidth_gbps[i, j]))
                                       for j, b in enumerate(peers) if j != i}) for i, a in enumerate(peers)}
    cluster = build_cluster(peers, records, rows, NO_EMULATION)
    workload = run_workload(TRAIN, 4, 4)
    starved = PlanConfig(time_budget_s=1e-6)  # before: one batch of moves, then "time budget"
    check = make_plan(cluster, workload, 4, starved, check=True)
    leader = make_plan(cluster, workload, 4, starved)
    assert check["search"]["stopped_by"] == "converged" and leader["pipelines"] == check["pipelines"]
    assert leader["cost_s"] == check["cost_s"] and "random" in leader["baselines"]
    capped = PlanConfig(verify_device_evaluations=16 * 200)  # a large run's check stops at its cap: the leader goes on
    check = make_plan(cluster, workload, 4, capped, check=True)
    leader = make_plan(cluster, workload, 4, capped)
    assert check["search"]["evaluations"] >= 200 and leader["search"]["evaluations"] > check["search"]["evaluations"]
    assert leader["cost_s"] <= check["cost_s"]


def test_a_check_that_reuses_our_search_costs_what_that_search_took(world, monkeypatch):
    """The trainers' no-show window is twice a follower's check; one that reused the search it made when the plan
    fell due (``searches._searched``) took milliseconds, and its window (16 s) halted a 32-agent epoch whose
    slower followers were still searching: the check costs what the search took."""
    from p2ptrain.agent.leadership import searches

    monkeypatch.setattr(searches, "_searched", type(searches._searched)())
    peers, records, rows = world
    best, _, _ = scored(peers, records, rows, peers[:4])
    plan = plan_record(peers, peers[:4], best)

    def gate():
        return PlanGate(peers[4], TRAIN, PlanConfig(), NO_EMULATION, LeaderWatch(10.0, 60.0), 0.0, lambda: rows,
                        workload_for)

    assert gate().accept(plan, records, lambda p: 60.0, first=True)
    (searched,) = searches._searched.values()
    searched["search"]["seconds"] = 30.0  # as if that search had taken 30 s (a busy machine)
    again = gate()
    assert again.accept(plan, records, lambda p: 60.0, first=True)
    assert again.check_s(plan) >= 30.0


def test_links_measured_after_the_plan_are_never_taken_for_measured_by_its_check(world):
    """The leader planned on rows in which its plan's neighbours had not measured each other (those links it
    estimated); they measure each other once the plan is out, and find those links slow. Checked on the rows as
    they are by then, the honest plan looks far worse than the follower's own and is refused; the plan names
    the version of each member's row its leader planned with (``PlanRecord.rows``), and the follower checks it
    on the rows cut back to those versions (``rows_as_planned``): accepted. A member whose row the leader did
    not have (version 0) is planned without its row, as the leader did."""
    peers, records, _ = world
    trainers = peers[:4]
    plan = plan_record(peers, trainers, (0, 1, 2, 3))  # pipelines 0 → 1 and 2 → 3, replicas 0-2 and 1-3
    neighbours = {frozenset(trainers[i] for i in pair) for pair in ((0, 1), (2, 3), (0, 2), (1, 3))}
    slow = LinkMeasurement(80.0, 0.001)

    def row(a: str) -> LinksRecord:
        then = {b: LinkMeasurement(10.0, 1.0) for b in peers if b != a and frozenset((a, b)) not in neighbours}
        later = {b: slow for b in peers if b != a and frozenset((a, b)) in neighbours}
        return LinksRecord.from_peers({**then, **later}, 200, {**{b: 100 for b in then}, **{b: 200 for b in later}})

    rows = {a: row(a) for a in peers}

    def gate():
        return PlanGate(peers[4], TRAIN, PlanConfig(verify_slack_s=0.0), NO_EMULATION, LeaderWatch(10.0, 60.0), 0.0,
                        lambda: rows, workload_for)

    assert not gate().accept(plan, records, lambda p: 60.0, first=True)  # on the rows as they are now
    versioned = dataclasses.replace(plan, rows=tuple(100 for _ in plan.membership))
    assert gate().accept(versioned, records, lambda p: 60.0, first=True)
    cut = rows_as_planned(versioned, rows)
    assert all(not set(cut[a].resolve(peers)) & {b for b in peers if frozenset((a, b)) in neighbours} for a in trainers)
    assert cut[peers[0]].resolve(peers) == {b: LinkMeasurement(10.0, 1.0) for b in (trainers[3], peers[4])}
    without = dataclasses.replace(plan, rows=(0,) + tuple(100 for _ in plan.membership[1:]))
    assert plan.membership[0] not in rows_as_planned(without, rows)
    assert rows_as_planned(plan, rows) == rows  # a leader that names no versions: the rows as read


def test_a_plan_is_checked_on_the_very_rows_its_leader_read_where_we_read_them_too(world):
    """A link's value changes after the plan too (a best guess replaced by an agreed measurement, a link measured
    again): cut back to the entries it had, a later row still holds today's values, and 15 followers of a
    16-agent swarm refused an honest plan on them (1.23x). A follower keeps the versions it read
    (``RowHistory``, every ``SwarmDHT.read_links``) and checks on the version its leader named."""
    from p2ptrain.net.dht.row_history import RowHistory

    peers, records, _ = world
    trainers = peers[:4]
    plan = plan_record(peers, trainers, (0, 1, 2, 3))
    neighbours = {frozenset(trainers[i] for i in pair) for pair in ((0, 1), (2, 3), (0, 2), (1, 3))}

    def row(a: str, version: int, slow: LinkMeasurement) -> LinksRecord:
        values = {b: slow if frozenset((a, b)) in neighbours else LinkMeasurement(10.0, 1.0) for b in peers if b != a}
        return LinksRecord.from_peers(values, version, dict.fromkeys(values, 100))

    then = {a: row(a, 100, LinkMeasurement(10.0, 1.0)) for a in peers}
    now = {a: row(a, 200, LinkMeasurement(80.0, 0.001)) for a in peers}  # the neighbours' links measured again
    versioned = dataclasses.replace(plan, rows=tuple(100 for _ in plan.membership))
    history = RowHistory()

    def gate():
        return PlanGate(peers[4], TRAIN, PlanConfig(verify_slack_s=0.0), NO_EMULATION, LeaderWatch(10.0, 60.0), 0.0,
                        lambda: now, workload_for, history=history)

    assert not gate().accept(versioned, records, lambda p: 60.0, first=True)  # today's values: refused
    history.note(then)  # we read the rows the leader planned with, before they changed
    history.note(now)
    assert gate().accept(versioned, records, lambda p: 60.0, first=True)
    assert rows_as_planned(versioned, now, history) == then


def test_the_row_history_keeps_the_last_versions_of_each_writer_and_finds_the_one_planned_with():
    from p2ptrain.net.dht.row_history import RowHistory

    a, b = generate_identity().peer_id, generate_identity().peer_id
    history = RowHistory(per_peer=3)

    def row(version: int, first: dict[str, int]) -> LinksRecord:
        return LinksRecord.from_peers({p: LinkMeasurement(float(version), 1.0) for p in first}, version, first)

    rows = {v: row(v, {b: 10} if v < 30 else {b: 10, a: 30}) for v in (10, 20, 30, 40)}
    for version in (10, 20, 30, 40):
        history.note({a: rows[version]})
    assert history.as_planned(a, 40, None) is rows[40] and history.as_planned(a, 20, None) is rows[20]
    assert history.as_planned(a, 10, None) == rows[20].as_of(10)  # 10 no longer kept (3 a writer): 20's, cut back
    assert history.as_planned(a, 25, None).resolve([a, b]) == {b: LinkMeasurement(30.0, 1.0)}  # 30's, cut back to 25
    assert history.as_planned(a, 50, None) is rows[40]  # newer than any we read: the last (it lacks what came since)
    assert history.as_planned(a, 0, rows[40]) is None  # the leader had no row of a
    assert history.as_planned(b, 5, None) is None  # nothing read of b
    latest = row(50, {b: 10})
    assert history.as_planned(b, 45, latest) == latest.as_of(45)  # the latest row given, cut back
    plain = LinksRecord.from_peers({b: LinkMeasurement(1.0, 1.0)})
    assert history.as_planned(a, 0, plain) is plain  # a writer that names no version: as it is
