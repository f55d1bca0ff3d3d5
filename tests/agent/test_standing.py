"""Who may lead (``leadership.standing``): the lowest live peer in standing once the run has a history, and
what a passed-over leader owes before it leads again. Pure: plan and progress records built here."""

from __future__ import annotations

import dataclasses

import pytest

from p2ptrain.agent.leadership.election import latest_plan
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.leadership.standing import Standing, followed_instead, made_progress
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity


@pytest.fixture(scope="module")
def ids():
    return sorted(generate_identity().peer_id for _ in range(6))  # ids[0] sorts lowest


def plan_of(signer: str, trainers: list[str], epoch: int, start: int = 0, spares: tuple[str, ...] = ()) -> PlanRecord:
    """Two stages, ``len(trainers) // 2`` pipelines, ``trainers`` in row-major order; signed by ``signer``."""
    membership = tuple(sorted({signer, *trainers, *spares}))
    index = {p: k for k, p in enumerate(membership)}
    pipelines = tuple((index[trainers[i]], index[trainers[i + 1]]) for i in range(0, len(trainers), 2))
    return PlanRecord(epoch=epoch, membership=membership, stages=2, replicas=len(pipelines), pipelines=pipelines,
                      cost_s=1.0, start_step=start, leader_at=index[signer])


def step(signer: str, epoch: int, done: int) -> ProgressRecord:
    """A trainer's progress record: ``done`` steps of ``epoch``, planned by ``signer``."""
    return ProgressRecord(epoch, done, None, 0.1, leader=signer)


def test_an_epoch_made_progress_only_if_most_of_its_trainers_trained_it_under_its_signer(ids):
    a, b, c, d, r = ids[1], ids[2], ids[3], ids[4], ids[0]
    plan = plan_of(a, [a, b, c, d], epoch=3, start=10)
    assert made_progress(plan, {a: step(a, 3, 12), b: step(a, 3, 12), c: step(a, 3, 11)})
    assert not made_progress(plan, {a: step(a, 3, 12), b: step(a, 3, 12), c: step(a, 3, 10)})  # 2 of 4: not most
    assert not made_progress(plan, {p: step(a, 2, 12) for p in (a, b, c, d)})  # another epoch
    # a copy of the same plan signed by the rogue: the trainers name the real signer, only the rogue names it
    copy = plan_of(r, [r, b, c, d], epoch=3, start=10)
    assert not made_progress(copy, {r: step(r, 3, 12), b: step(a, 3, 12), c: step(a, 3, 12), d: step(a, 3, 12)})


def test_before_any_progress_the_lowest_leads_after_it_only_peers_that_trained(ids):
    rogue, a, b, c, d, fresh = ids
    standing = Standing()
    live = {rogue, a, b, c, d}
    assert standing.leader(live) == rogue  # nobody has history: the lowest live peer leads the first plan
    first = plan_of(a, [a, b, c, d], epoch=0)
    standing.observe([first], {p: step(a, 0, 0) for p in (a, b, c, d)})
    assert not standing.history and standing.leader(live) == rogue  # planned, but no step trained yet
    standing.observe([first, None], {p: step(a, 0, 2) for p in (a, b, c, d)})
    assert standing.history
    assert standing.leader(live) == a  # the rogue (and a fresh key) sorts lower, but never trained
    assert standing.leader(live | {fresh}) == a and not standing.in_standing(fresh)
    # the rogue as a trainer of a later epoch that made progress: it has shown work, and may lead
    second = plan_of(a, [rogue, b, c, d], epoch=1, start=2, spares=(a,))
    standing.observe([second], {p: step(a, 1, 5) for p in (rogue, b, c)})
    assert standing.leader(live) == rogue
    # if every peer in standing left, the run goes on: the lowest live peer leads
    assert standing.leader({fresh}) == fresh


def test_a_passed_over_leader_owes_doubling_epochs_of_training(ids):
    rogue, a, b, c, d, _ = ids
    live = {rogue, a, b, c, d}
    watch = LeaderWatch(grace_s=1.0, backoff_s=10.0, clock=lambda: 0.0)
    standing = watch.standing
    epoch = 0

    def trained(trainers: list[str]) -> None:
        nonlocal epoch
        plan = plan_of(a, trainers, epoch=epoch, start=epoch)
        standing.observe([], {p: step(a, epoch, epoch + 1) for p in trainers}, followed=[plan])
        epoch += 1

    trained([rogue, b, c, d])
    assert standing.leader(live) == rogue
    assert watch.pass_over(rogue) == 10.0  # first pass-over: it owes one epoch
    assert standing.owes(rogue) == 1 and standing.leader(live) == a
    trained([a, b, c, d])  # an epoch it did not train pays nothing
    assert standing.owes(rogue) == 1 and standing.leader(live) == a
    trained([rogue, b, c, d])
    assert standing.owes(rogue) == 0 and standing.leader(live) == rogue
    assert watch.pass_over(rogue) == 20.0  # second pass-over: two epochs, whatever the clock says
    trained([rogue, b, c, d])
    assert standing.owes(rogue) == 1 and standing.leader(live) == a
    trained([rogue, b, c, d])
    assert standing.leader(live) == rogue
    # passed over before the run had any history (the first plan's leader): it owes all the same
    fresh = Standing()
    fresh.passed_over(rogue, 1)
    assert fresh.leader(live) == a


def test_the_membership_and_the_plan_followed_use_the_leader_in_standing(ids):
    rogue, a, b, c, d, _ = ids
    standing = Standing()
    plan = plan_of(a, [a, b, c, d], epoch=0)
    standing.observe([plan], {p: step(a, 0, 1) for p in (a, b, c, d)})
    members = Membership({p: None for p in (rogue, a, b, c, d)}, standing)
    assert members.leader == a and members.without(a).leader == b
    assert Membership({p: None for p in (rogue, a)}).leader == rogue  # no standing: the lowest
    rogues = plan_of(rogue, [a, b, c, d], epoch=1, start=1)
    plans = {a: plan_of(a, [a, b, c, d], epoch=1, start=1), rogue: rogues}
    assert latest_plan(plans, members.ids, b, 0, leader=members.leader) is plans[a]
    assert latest_plan(plans, members.ids, b, 0) is rogues  # the bare rule would follow the lowest
    assert rogues.leader == rogue and plans[a].leader == a  # a plan names its signer, not its lowest member
    assert PlanRecord.decode(plans[a].encode()) == plans[a]  # ``leader_at`` travels (additive: 0 is absent)
    with pytest.raises(ValueError, match="leader_at"):
        dataclasses.replace(plans[a], leader_at=len(plans[a].membership))


def test_a_group_of_keys_vouching_for_itself_earns_nothing_with_an_agent_that_trains_the_run(ids):
    r1, r2, r3, a, b, c = ids  # the group sorts lowest
    group = plan_of(r1, [r2, r3], epoch=7)  # a plan among themselves, and progress records of it
    fake = {r2: step(r1, 7, 5), r3: step(r1, 7, 5)}
    run = plan_of(a, [a, b], epoch=0, spares=(c,))
    trained = {p: step(a, 0, 3) for p in (a, b)}
    agent = Standing()
    agent.observe([group], {**fake, **trained}, followed=[run])
    assert agent.leader({r1, r2, r3, a, b, c}) == a and not agent.in_standing(r1)
    agent.observe([group, run], {**fake, **trained})
    assert not agent.in_standing(r2)  # read again later: still nothing
    # a joiner (nothing followed yet) learns from what it reads, provisionally: the group sorts lowest, so it
    # may take it for the run's leader until a plan it follows moves; then only its own history counts
    joiner = Standing()
    joiner.observe([group, run], {**fake, **trained})
    assert joiner.in_standing(r1) and joiner.in_standing(a)
    admitted = plan_of(a, [a, b, c, r3], epoch=1, start=3)  # r3 admitted as a trainer: it may earn standing
    moving = {p: step(a, 1, 4) for p in (a, b, c)}
    joiner.observe([group, admitted], {**fake, **moving}, followed=[admitted])
    assert joiner.leader({r1, r2, r3, a, b, c}) == a and not joiner.in_standing(r1) and not joiner.in_standing(r3)


def test_a_leader_whose_run_trains_another_signers_plan_sees_it_was_passed_over(ids):
    """The issue-45 stranding: leader L trained epoch 0 with a, b, c (its history), its followers passed it over
    and a's plan (numbered 1, as L's own re-plan is) is what they train: L sees the run follows a instead."""
    lead, a, b, c, _, fresh = ids
    standing = Standing()
    first = plan_of(lead, [lead, a, b, c], epoch=0)
    standing.observe([], {p: step(lead, 0, 2) for p in (lead, a, b, c)}, followed=[first])
    ours = plan_of(lead, [lead, a, b, c], epoch=1, start=2)  # L's own re-plan, which nobody takes up
    theirs = plan_of(a, [a, b, c, fresh], epoch=1, start=2, spares=())
    live = {lead, a, b, c, fresh}
    training = {a: step(a, 1, 4), b: step(a, 1, 4), c: step(a, 1, 3), fresh: step(a, 1, 4), lead: step(lead, 1, 2)}
    assert followed_instead(lead, [ours], {lead: ours, a: theirs}, live, training, standing) == theirs
    # not while the run trains ours, nor before theirs moved, nor for a signer that is not live
    ours_moving = {**training, **{p: step(lead, 1, 4) for p in (a, b, c)}}
    assert followed_instead(lead, [ours], {lead: ours, a: theirs}, live, ours_moving, standing) is None
    assert followed_instead(lead, [ours], {lead: ours, a: theirs}, live, {p: step(a, 1, 2) for p in live},
                            standing) is None
    assert followed_instead(lead, [ours], {lead: ours, a: theirs}, live - {a}, training, standing) is None
    # a plan trained only by keys with no history in this run counts for nothing
    strangers = sorted(generate_identity().peer_id for _ in range(4))
    cabal = plan_of(strangers[0], strangers, epoch=5)
    cabal_training = {**training, **{p: step(strangers[0], 5, 3) for p in strangers}}
    assert followed_instead(lead, [ours], {lead: ours, strangers[0]: cabal}, live | set(strangers), cabal_training,
                            standing) is None


def test_members_of_an_open_dispute_wait_to_lead_while_a_calm_peer_in_standing_is_live(ids):
    """The issue-45 takeover: leader ``lead`` kept the rogue and its honest counterpart apart; passed over, the
    run goes to the lowest calm peer in standing, not to the rogue that sorts next (whose own finding as leader
    would quarantine its counterpart)."""
    rogue, lead, honest, a, b, _ = ids
    standing = Standing()
    first = plan_of(lead, [rogue, honest, a, b], epoch=0)
    standing.observe([], {p: step(lead, 0, 2) for p in (rogue, honest, a, b)}, followed=[first])
    live = {rogue, honest, a, b}
    assert standing.leader(live) == rogue  # no dispute yet: the lowest in standing
    index = {p: k for k, p in enumerate(first.membership)}
    apart = dataclasses.replace(plan_of(lead, [rogue, a, honest, b], epoch=1, start=2),
                                apart=(tuple(sorted((index[rogue], index[honest]))),))
    standing.observe([apart], {}, followed=[apart])
    assert standing.disputed == {rogue, honest} and standing.kept_apart == (lead, {frozenset((rogue, honest))})
    assert standing.leader(live | {lead}) == lead  # the signer of the pairs leads on
    assert standing.leader(live) == a  # passed over: the lowest calm peer, not the rogue nor its counterpart
    assert standing.leader({rogue, honest}) == rogue  # nobody calm is left: the lowest in standing, as before
    # a plan by a signer nobody trusts says nothing about disputes; the next trusted plan's pairs replace these
    stranger = sorted(generate_identity().peer_id for _ in range(1))[0]
    standing.observe([dataclasses.replace(plan_of(stranger, [a, b, rogue, honest], epoch=5), apart=((0, 1),))], {})
    assert standing.disputed == {rogue, honest}
    # the next plan has no pairs (the rogue quarantined out of it, the pair expired): the honest counterpart is
    # calm once it trained an epoch of progress under it; the rogue, which trains nothing, waits on
    calm = plan_of(a, [honest, a, b, lead], epoch=2, start=3)
    standing.observe([calm], {}, followed=[calm])
    assert standing.disputed == {rogue, honest} and standing.leader(live) == a
    standing.observe([calm], {p: step(a, 2, 5) for p in (honest, a, b, lead)}, followed=[calm])
    assert standing.disputed == {rogue} and standing.leader(live) == honest
    # the rogue back from quarantine, trained an epoch without a dispute: it may lead again
    back = plan_of(a, [rogue, honest, a, b], epoch=3, start=5)
    standing.observe([back], {p: step(a, 3, 7) for p in (rogue, honest, a, b)}, followed=[back])
    assert standing.disputed == frozenset() and standing.leader(live) == rogue
