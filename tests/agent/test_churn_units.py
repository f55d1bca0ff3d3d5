"""The pure parts of churn handling: the restart step, the re-plan decision, plan selection by epoch, the
churn fields of the records, and the state a trainer keeps and sends (over a real loopback transport)."""

from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.agent.churn.replan import FAILURE, JOIN, ReplanWatch, refused_cap
from p2ptrain.agent.churn.restart import (
    CHECKPOINT,
    INIT,
    Holding,
    holding_of,
    join_start,
    restart_point,
    source_indices,
    source_of,
)
from p2ptrain.agent.churn.stage_state import StateKeeper, recv_state, send_state
from p2ptrain.agent.config import ChurnConfig
from p2ptrain.agent.leadership.election import finished_without, latest_plan
from p2ptrain.agent.leadership.plan_maker import replicas_for
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.outer import Rounds
from p2ptrain.model.stage import build_stage
from p2ptrain.net.dht.records import SOURCE_CHECKPOINT, PlanRecord, ProgressRecord, RecordError
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.checkpoint import state_tensors
from p2ptrain.runtime.config import TrainConfig

PEERS = sorted(generate_identity().peer_id for _ in range(7))
A, B, C, D, E, F, G = PEERS


def plan_of(epoch: int, members, rows, start_step: int = 0, sources=()) -> PlanRecord:
    members = tuple(sorted(members))
    pipelines = tuple(tuple(members.index(p) for p in row) for row in rows)
    return PlanRecord(epoch=epoch, membership=members, stages=len(rows[0]), replicas=len(rows), pipelines=pipelines,
                      cost_s=1.0, start_step=start_step, sources=tuple(sources))


# ---- restart_point --------------------------------------------------------------------------------------


def test_restart_is_the_highest_step_every_stage_holds():
    # stage 0's survivor did step 5, stage 1's replicas 4 and 5 (keeping the step before too): restart at 5
    holdings = {A: Holding(0, 4, 5), B: Holding(1, 3, 4), C: Holding(1, 4, 5)}
    restart = restart_point(2, holdings)
    assert restart.step == 5 and restart.sources == (A, C) and not restart.from_checkpoint
    # stage 1 only reached 4: stage 0 rolls back to its kept step 4
    restart = restart_point(2, {A: Holding(0, 4, 5), B: Holding(1, 3, 4)})
    assert restart.step == 4 and restart.sources == (A, B)


def test_the_lowest_holder_is_the_source():
    assert restart_point(1, {C: Holding(0, 2, 3), B: Holding(0, 2, 3)}).sources == (B,)


def test_a_lost_stage_falls_back_to_the_last_checkpoint_or_the_seed():
    restart = restart_point(2, {A: Holding(0, 6, 7)}, checkpoints=[4])
    assert restart.step == 4 and restart.sources == (CHECKPOINT, CHECKPOINT)
    assert restart.from_checkpoint and restart.lost_stages == (1,)
    restart = restart_point(2, {A: Holding(0, 6, 7)})
    assert restart.step == 0 and restart.sources == (INIT, INIT)


def test_a_checkpoint_behind_the_survivors_is_not_used():
    restart = restart_point(2, {A: Holding(0, 6, 7), B: Holding(1, 6, 7)}, checkpoints=[6])
    assert restart.step == 7 and restart.sources == (A, B)


def test_holdings_from_halted_heartbeats_stay_inside_the_epoch():
    plan = plan_of(3, [A, B, C, D], [[A, B], [C, D]], start_step=5)
    assert holding_of(plan, C, 7, 2) == Holding(0, 6, 7)
    assert holding_of(plan, D, 5, 2) == Holding(1, 5, 5)  # nothing before the epoch's start
    assert holding_of(plan, B, 5, 0) is None and holding_of(plan, E, 5, 2) is None
    # a peer that failed before taking up its new stage still keeps its old stage's states
    assert holding_of(plan, E, 4, 2, stage=1) == Holding(1, 3, 4)


def test_sources_round_trip_through_the_plan_record():
    members = (A, B, C)
    plan = plan_of(1, members, [[A, B]], start_step=4, sources=source_indices([C, CHECKPOINT], members))
    assert plan.sources == (2, SOURCE_CHECKPOINT)
    decoded = PlanRecord.decode(plan.encode())
    assert decoded == plan and [source_of(decoded, j) for j in range(2)] == [C, CHECKPOINT]
    assert source_of(plan_of(0, members, [[A, B]]), 1) == INIT
    with pytest.raises(RecordError):
        plan_of(1, members, [[A, B]], start_step=4, sources=source_indices([INIT, INIT], members))
    with pytest.raises(RecordError):
        plan_of(1, members, [[A, B]], sources=(7, 0))


def test_progress_records_carry_halted_and_kept():
    record = ProgressRecord(2, 7, None, 0.0, halted=True, kept=2, stage=1)
    assert ProgressRecord.decode(record.encode()) == record
    assert ProgressRecord.decode(ProgressRecord(2, 7, 1.5, 0.1).encode()).halted is False


def test_replicas_keep_the_global_batch_split():
    train = TrainConfig(stages=3, global_batch_size=16, micro_batches=2)
    assert [replicas_for(n, train) for n in (3, 5, 6, 7, 9, 12)] == [1, 1, 2, 2, 2, 4]
    assert replicas_for(2, train) == 0
    assert join_start([3, 4]) == 6 and join_start([]) == 2


def test_a_join_starts_past_the_current_epochs_start_before_any_progress_of_it_is_seen():
    # a leader new to epoch 1 (it started at step 127) reads no progress of it yet: the next epoch must not
    # start behind the step its trainers already hold
    assert join_start([], 127) == 129 and join_start([130], 127) == 132


# ---- ReplanWatch ----------------------------------------------------------------------------------------

PLAN = plan_of(1, [A, B, C, D, E], [[A, B], [C, D]])  # E is a spare


def halted(step: int, kept: int = 2, epoch: int = 1) -> ProgressRecord:
    return ProgressRecord(epoch, step, None, 0.0, halted=True, kept=kept)


def test_a_dead_trainer_is_replanned_once_the_survivors_halted():
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=30))
    live = [A, C, D, E]  # B died
    assert watch.check(PLAN, live, {}, steps=10, checkpoints=[], now=0.0) is None  # nobody halted yet
    assert watch.check(PLAN, live, {A: halted(4)}, steps=10, checkpoints=[], now=0.0) is None
    assert "waiting" in watch.note
    replan = watch.check(PLAN, live, {A: halted(4), C: halted(5), D: halted(4)}, steps=10, checkpoints=[], now=1.0)
    assert replan.kind == FAILURE and replan.members == (A, C, D, E) and B in replan.reason
    assert replan.restart.step == 4 and replan.restart.sources == (A, D)  # C (stage 0, step 5) rolls back to 4


def test_a_refused_step_is_rolled_back_everywhere_and_its_culprit_is_no_source():
    # C (stage 0) sent wrong activations at step 4: its verifier A refused the step (keeps 3 and 4); C and the
    # stage after it (B, D) applied it, their own checks passing, and keep 4 and 5
    record = ProgressRecord(1, 4, None, 0.0, halted=True, kept=2, blame=C, refused=True)
    assert ProgressRecord.decode(record.encode()) == record
    with pytest.raises(RecordError, match="refused"):
        ProgressRecord(1, 4, None, 0.0, halted=True, refused=True)  # a refusal names whom
    trainers = {A: record, B: halted(5), C: halted(5), D: halted(5)}
    replan = ReplanWatch(ChurnConfig()).check(PLAN, [A, B, C, D, E], trainers, steps=10, checkpoints=[], now=0.0)
    assert replan.restart.step == 4 and replan.restart.sources == (A, B)
    unrefused = dict(trainers, **{A: halted(4)})
    assert ReplanWatch(ChurnConfig()).check(PLAN, [A, B, C, D, E], unrefused, steps=10, checkpoints=[],
                                            now=0.0).restart.step == 5


def test_a_step_refused_in_the_next_ones_shadow_is_rolled_back_from_three_kept_states():
    # the recompute check of step 4 ends at step 5's hook (``verify.recompute_check``): its finder A applied 4 and
    # reports only the state before it (``epoch._halt``); B, C and D applied 5 too and keep 4, 5 and 6
    trainers = {A: ProgressRecord(1, 4, None, 0.0, halted=True, kept=2, blame=C, refused=True),
                B: halted(6, kept=3), C: halted(6, kept=3), D: halted(6, kept=3)}
    replan = ReplanWatch(ChurnConfig()).check(PLAN, [A, B, C, D, E], trainers, steps=10, checkpoints=[5, 6], now=0.0)
    assert replan.restart.step == 4 and replan.restart.sources == (A, B)
    # nor is a checkpoint after the refused step (without the cap, 6 from the checkpoint for every stage)
    capped = ReplanWatch(ChurnConfig()).check(PLAN, [A, B, E], {A: trainers[A], B: trainers[B]}, steps=10,
                                            checkpoints=[2, 6], now=0.0)
    assert capped.restart.step == 4 and capped.restart.sources == (A, B)
    assert refused_cap(trainers) == 4 and refused_cap({B: halted(6)}) is None


def test_a_trainer_that_never_halts_is_left_out_after_the_timeout():
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=5))
    progress = {A: halted(4), B: halted(4), C: halted(4)}
    assert watch.check(PLAN, PEERS[:5], progress, steps=10, checkpoints=[], now=0.0) is None
    replan = watch.check(PLAN, PEERS[:5], progress, steps=10, checkpoints=[], now=6.0)
    assert replan.members == (A, B, C, E) and "left out" in replan.reason


def test_a_lost_stage_restarts_from_the_checkpoint():
    replan = ReplanWatch(ChurnConfig()).check(PLAN, [A, C, E], {A: halted(7), C: halted(7)}, steps=10,
                                              checkpoints=[6], now=0.0)
    assert replan.restart.step == 6 and replan.restart.from_checkpoint and "checkpoint of step 6" in replan.reason


def test_joiners_wait_for_the_configured_count_or_steps():
    progress = {A: ProgressRecord(1, 3, None, 0.1)}
    watch = ReplanWatch(ChurnConfig(join_min_new_peers=2, join_every_steps=4))
    assert watch.check(PLAN, [A, B, C, D, E, F], progress, steps=10, checkpoints=[], now=0.0, done=3) is None
    replan = watch.check(PLAN, [A, B, C, D, E, F, G], progress, steps=10, checkpoints=[], now=0.0, done=3)
    assert replan.kind == JOIN and replan.members == tuple(PEERS) and replan.restart is None
    watch.reset()
    assert watch.check(PLAN, [A, B, C, D, E, F], progress, steps=10, checkpoints=[], now=0.0, done=3) is None
    assert watch.check(PLAN, [A, B, C, D, E, F], progress, steps=10, checkpoints=[], now=0.0, done=7).kind == JOIN


def test_joiners_are_not_admitted_when_the_epoch_starts_too_late_for_a_re_plan_point():
    late = plan_of(1, [A, B, C, D, E], [[A, B], [C, D]], start_step=8)  # nobody said a step of it yet
    watch = ReplanWatch(ChurnConfig(join_min_new_peers=1))
    assert watch.check(late, [A, B, C, D, E, F], {}, steps=10, checkpoints=[], now=0.0) is None
    assert watch.check(late, [A, B, C, D, E, F], {}, steps=20, checkpoints=[], now=0.0).kind == JOIN


def test_trainers_that_finished_before_a_failure_are_sources_not_waited_for():
    progress = {A: ProgressRecord(1, 10, 3.0, 0.1), B: halted(9), C: ProgressRecord(1, 10, None, 0.1)}
    replan = ReplanWatch(ChurnConfig()).check(PLAN, [A, B, C, E], progress, steps=10, checkpoints=[], now=0.0)
    assert replan.kind == FAILURE and replan.restart.step == 9 and replan.restart.sources == (A, B)


def test_nothing_is_replanned_after_the_last_step():
    finished = {p: ProgressRecord(1, 10, None, 0.1) for p in (A, B, C, D)}
    assert ReplanWatch(ChurnConfig()).check(PLAN, [A, C, D, E, F], finished, steps=10, checkpoints=[], now=0.0) is None


# ---- latest_plan ----------------------------------------------------------------------------------------


def test_the_highest_epoch_of_the_lowest_live_peer_is_followed():
    old = plan_of(1, [A, B, C], [[A, B, C]])
    new = plan_of(2, [B, C, D], [[B, C, D]])
    plans = {A: old, B: new}
    assert latest_plan(plans, [A, B, C, D], C, after_epoch=0) == old  # A is still live: its plan stands
    assert latest_plan(plans, [B, C, D], C, after_epoch=1) == new  # A's record expired: B leads
    assert latest_plan(plans, [B, C, D], C, after_epoch=2) is None  # already followed
    assert latest_plan(plans, [B, C, D, E], E, after_epoch=0) is None  # not a member: a joiner waits
    assert latest_plan({C: new}, [B, C, D], D, after_epoch=0) is None  # signed by someone who is not the leader


def test_an_agent_cut_off_until_the_run_finished_finds_it_finished_by_its_peers_records():
    # A was cut off in epoch 1; B, C, D re-planned without it (epoch 2, signed by B) and finished 12 steps,
    # then left: A's view no longer has B live, but B's plan and their progress records outlive them
    first = plan_of(1, [A, B, C, D], [[A, B], [C, D]])
    without_a = plan_of(2, [B, C, D], [[B, C]], start_step=2)  # D a spare
    done = {B: ProgressRecord(2, 12, 3.1, 0.1), C: ProgressRecord(2, 12, 3.1, 0.1)}

    def finished(plans, me, followed, progress):
        return finished_without(plans, me, followed, lambda: progress, 12)

    assert finished([None, without_a], A, 1, done) == without_a
    assert finished([without_a], A, 1, {**done, C: ProgressRecord(2, 11, 3.2, 0.1)}) is None  # C: not yet
    assert finished([without_a], A, 1, {B: done[B]}) is None  # C's record says nothing
    assert finished([without_a], A, 1, {**done, C: ProgressRecord(1, 12, 3.1, 0.1)}) is None  # an old epoch
    assert finished([without_a], D, 1, done) is None  # D is a member: it finishes with them
    assert finished([first], A, 0, {A: ProgressRecord(1, 12, 3.1, 0.1)}) is None  # A's own plan
    assert finished([without_a], A, 2, done) is None  # not newer than what A followed

    def unread():
        raise AssertionError("progress read though no plan left A out")

    assert finished_without([first, None], A, 0, unread, 12) is None


def test_a_leader_passed_over_finds_the_run_finished_by_the_plan_of_its_own_epoch_number():
    # A led epoch 0 and published epoch 1 for its swarm; its followers had passed it over and B numbered its own
    # plan 1 too, which they trained to the end: A, whose last followed plan is its own epoch 1, sees it finished
    ours = dataclasses.replace(plan_of(1, [A, B, C, D], [[A, B], [C, D]]), leader_at=0)
    theirs = dataclasses.replace(plan_of(1, [B, C, D], [[B, C]], start_step=2), leader_at=0)  # signed by B
    done = {p: ProgressRecord(1, 12, 3.1, 0.1, leader=B) for p in (B, C)}
    assert theirs.leader == B and ours.leader == A
    assert finished_without([theirs], A, 1, lambda: done, 12, followed_leader=A) == theirs
    assert finished_without([theirs], A, 1, lambda: done, 12, followed_leader=B) is None  # the plan A followed
    assert finished_without([theirs], A, 2, lambda: done, 12, followed_leader=A) == theirs  # A numbered above it
    # records of epoch 1 that name another signer (A's own epoch 1) say nothing of B's plan
    other = {p: ProgressRecord(1, 12, 3.1, 0.1, leader=A) for p in (B, C)}
    assert finished_without([theirs], A, 1, lambda: other, 12, followed_leader=A) is None


# ---- the kept state and its transfer ---------------------------------------------------------------------


def trained_stage(steps: int):
    cfg = TrainConfig()
    module = build_stage(cfg.shape, 0, 2, cfg.seed, torch.device("cpu"))
    optimizer = build_optimizer(module, cfg.optimizer)
    for _ in range(steps):
        module.zero_grad()
        sum(p.square().sum() for p in module.parameters()).backward()
        optimizer.step()
    return cfg, module, optimizer


def test_the_keeper_keeps_the_last_states_of_one_stage():
    _, module, optimizer = trained_stage(1)
    keeper = StateKeeper(keep=2)
    keeper.reset(0, 2, 3, state_tensors(module, optimizer))
    for step in (4, 5):
        keeper.record(step, module, optimizer)
    assert keeper.kept == 2 and keeper.latest_step == 5
    assert keeper.get(0, 2, 3) is None and keeper.get(0, 2, 4) is not None and keeper.get(1, 2, 5) is None
    assert keeper.digest() == StateKeeper.digest(keeper) and len(keeper.digest()) == 64


def test_the_kept_state_is_the_state_of_its_step_not_of_a_later_one():
    _, module, optimizer = trained_stage(1)
    keeper = StateKeeper(keep=2)
    keeper.reset(0, 2, 0, {})
    keeper.record(1, module, optimizer)
    want = state_tensors(module, optimizer)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the next step changes the stage in place
    got = keeper.get(0, 2, 1)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path of the keeper needs CUDA")
def test_a_gpu_stage_is_kept_without_waiting_for_the_copy_and_as_it_was_at_its_step():
    cfg = TrainConfig(model="small", stages=2, replicas=1, global_batch_size=8, steps=2)
    module = build_stage(cfg.shape, 0, 2, cfg.seed, torch.device("cuda"))
    optimizer = build_optimizer(module, cfg.optimizer)
    sum(p.square().sum() for p in module.parameters()).backward()
    optimizer.step()
    keeper = StateKeeper(keep=2)
    keeper.reset(0, 2, 0, {})
    keeper.record(1, module, optimizer)  # queued on a stream of its own, after the step
    want = state_tensors(module, optimizer)  # the same, copied while we wait
    for _ in range(3):  # the next steps change the stage in place, after the copy (as the executor fences)
        module.zero_grad()
        sum(p.square().sum() for p in module.parameters()).backward()
        keeper.fence()
        optimizer.step()
    got = keeper.get(0, 2, 1)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.device.type == "cpu" and t.is_pinned() for k, t in got.items() if k.startswith("param/"))
    keeper.record(2, module, optimizer)
    assert len(keeper.digest()) == 64  # waits for step 2's copy


@pytest.mark.timeout(60)
def test_a_state_sent_over_the_transport_arrives_whole():
    from p2ptrain.net.transport.endpoint import Transport

    cfg, module, optimizer = trained_stage(2)
    state = state_tensors(module, optimizer)
    with Transport("churn") as sender, Transport("churn", initial_peers=sender.visible_maddrs) as receiver:
        receiver.set_window("churn", 0, 0)  # still in an older epoch: the state of epoch 1 is taken ahead
        futures = send_state(sender, str(receiver.peer_id), "churn", 1, 2, state, module, timeout_s=20)
        receiver.set_window("churn", 1, 2)
        fresh = build_stage(cfg.shape, 0, 2, cfg.seed, torch.device("cpu"))
        got = recv_state(receiver, str(sender.peer_id), "churn", 1, 2, fresh, timeout_s=20)
        for future in futures:
            future.result(timeout=20)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.timeout(60)
def test_a_receiver_that_never_takes_up_the_plan_is_the_one_a_refused_hand_over_blames():
    from p2ptrain.agent.churn.stage_state import REFUSED_BLAME_S
    from p2ptrain.agent.epoch import blamed_peer
    from p2ptrain.errors import MessageRejected, PeerFailed
    from p2ptrain.net.transport.endpoint import Transport

    cfg, module, optimizer = trained_stage(2)
    state = state_tensors(module, optimizer)
    with Transport("churn") as sender, Transport("churn", initial_peers=sender.visible_maddrs) as receiver:
        me, it = str(sender.peer_id), str(receiver.peer_id)
        plan = SimpleNamespace(membership=(me, it))  # what ``blamed_peer`` reads of a plan (transports' IDs are not RSA)
        receiver.set_window("churn", 0, 0)  # it never took up epoch 2: every part is refused as too far ahead
        futures = send_state(sender, it, "churn", 2, 2, state, module, timeout_s=30)
        time.sleep(REFUSED_BLAME_S + 1.0)  # refused that long ...
        sender.abort_epoch(2, "peer X failed the epoch")  # ... until a third peer's failure aborts our epoch
        errors = [f.exception(timeout=20) for f in futures]
        assert all(isinstance(e, MessageRejected) and "too far ahead" in str(e) for e in errors), errors
        assert {blamed_peer(e, plan) for e in errors} == {it}  # not nobody, as the abort alone would say

        # refused only a moment before the abort: an honest receiver still halting its last epoch, not blamed
        receiver.set_window("churn", 1, 0)
        futures = send_state(sender, it, "churn", 3, 2, state, module, timeout_s=30)
        time.sleep(0.5)
        sender.abort_epoch(3, "peer X failed the epoch")
        errors = [f.exception(timeout=20) for f in futures]
        assert all(isinstance(e, PeerFailed) for e in errors), errors
        assert {blamed_peer(e, plan) for e in errors} == {None}


# ---- DiLoCo: committed states are rounds' ends ----------------------------------------------------------

ROUNDS = Rounds(length=3, total_steps=10)  # rounds end after steps 3, 6, 9 and 10


def test_a_diloco_restart_is_the_last_rounds_end_every_stage_holds():
    # stage 0's survivor kept rounds' ends 3 and 6, stage 1's only 3 (it died inside round 2's all-reduce)
    holdings = {A: holding_of(PLAN, A, 6, 2, 0, ROUNDS), C: holding_of(PLAN, C, 3, 2, 1, ROUNDS)}
    assert holdings[A] == Holding(0, 3, 6) and holdings[C] == Holding(1, 0, 3)
    restart = restart_point(2, holdings, rounds=ROUNDS)
    assert restart.step == 3 and restart.sources == (A, C)
    # a checkpoint inside a round is no state to restart from; steps between kept rounds' ends neither
    assert restart_point(2, {A: Holding(0, 3, 6)}, checkpoints=[5], rounds=ROUNDS).step == 0
    assert restart_point(1, {A: Holding(0, 3, 6)}, rounds=ROUNDS).step == 6
    assert restart_point(1, {A: Holding(0, 4, 5)}, rounds=ROUNDS).step == 0


def test_a_diloco_join_waits_for_a_rounds_end():
    assert [join_start([s], rounds=ROUNDS) for s in (0, 1, 2, 4, 7, 8)] == [3, 3, 6, 6, 9, 10]
    assert [s for s in range(11) if ROUNDS.committed(s)] == [0, 3, 6, 9, 10]
    # no join re-plan when the next round's end is the run's last step
    watch = ReplanWatch(ChurnConfig(join_min_new_peers=1), ROUNDS)
    progress = {p: ProgressRecord(1, 8, None, 0.1) for p in (A, B, C, D)}
    assert watch.check(PLAN, [A, B, C, D, E, F], progress, 10, [], now=0.0) is None
    progress = {p: ProgressRecord(1, 4, None, 0.1) for p in (A, B, C, D)}
    assert watch.check(PLAN, [A, B, C, D, E, F], progress, 10, [], now=0.0).kind == JOIN


def test_the_keeper_states_of_a_diloco_run_carry_the_outer_momentum():
    from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer

    cfg, module, optimizer = trained_stage(2)
    outer = OuterOptimizer(list(module.parameters()), DiLoCoConfig(inner_steps=2))
    outer.step(outer.pseudo_gradients())
    keeper = StateKeeper()
    keeper.reset(0, 2, 0, state_tensors(module, optimizer))
    keeper.record(2, module, optimizer, outer)
    kept = keeper.get(0, 2, 2)
    names = [n for n in kept if n.startswith("outer/momentum/")]
    assert len(names) == len(list(module.parameters()))


def test_an_overlapped_round_end_is_kept_once_its_mean_gives_the_anchor():
    """``overlap``: a round's end is held (not restarted from: not ``kept``) until the next round's end completes
    it with the anchor and momentum the round's mean gave; the inner moments are those of its own end."""
    from p2ptrain.model.outer import DiLoCoConfig, OuterOptimizer
    from p2ptrain.runtime.checkpoint import outer_tensors

    cfg, module, optimizer = trained_stage(2)
    outer = OuterOptimizer(list(module.parameters()), DiLoCoConfig(inner_steps=2, overlap=True))
    keeper = StateKeeper()
    keeper.reset(0, 2, 0, state_tensors(module, optimizer))
    with torch.no_grad():
        for k, p in enumerate(module.parameters()):  # the round's inner steps moved them
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 1e-2)
    deltas = outer.pseudo_gradients()
    outer.start = outer.tentative([d * 0.5 for d in deltas])  # its own guess, not the mean
    outer.reset(outer.params, outer.start)
    keeper.hold(2, module, optimizer, outer)
    moments = {n: t.clone() for n, t in keeper._held[1].items() if n.startswith("adam/")}
    assert keeper.held_step == 2 and keeper.latest_step == 0 and keeper.complete({}) == 2
    keeper.hold(2, module, optimizer, outer)
    outer.advance(deltas)  # the mean is in (the next round's end)
    assert keeper.complete(outer_tensors(module, outer)) == 2 and keeper.held_step is None
    kept = keeper.get(0, 2, 2)
    for (name, _), anchor in zip(module.named_parameters(), outer.anchor, strict=True):
        assert torch.equal(kept["param/" + name], anchor) and not torch.equal(kept["param/" + name],
                                                                           dict(module.named_parameters())[name])
    assert all(torch.equal(kept[n], t) for n, t in moments.items())


def test_a_progress_record_leaves_out_an_mfu_no_device_reaches():
    # a volunteer whose profile measured its peak on a loaded machine saw 10.34 (1,034 %): its own progress record
    # refused the value and the agent exited (a CI run); the record now leaves it out, the step event keeps it
    from p2ptrain.agent.epoch import record_mfu

    assert record_mfu(0.42) == 0.42 and record_mfu(None) is None
    for wrong in (10.34, -0.1, math.inf, math.nan):
        assert record_mfu(wrong) is None
    assert ProgressRecord(0, 3, 4.2, 0.5, mfu=record_mfu(10.34)).mfu is None


def test_most_trainers_not_halting_are_not_all_culprits_but_a_few_are():
    """Honest peers are the many: when most of an epoch's trainers never halt (59 of 64 agents on two cores still
    checked the plan themselves when the leader's no-show window ended), the failure is the run's, and they stay
    members; one or two of them are left out and are the culprits."""
    plan = plan_of(1, PEERS[:6], [[A, B], [C, D], [E, F]])
    watch = ReplanWatch(ChurnConfig(halt_timeout_s=5))
    absent = [B, C, D, E, F]
    replan = watch.check(plan, PEERS[:6], {A: halted(0)}, steps=10, checkpoints=[], now=0.0, absent=absent)
    assert replan.kind == FAILURE and replan.members == tuple(PEERS[:6]) and replan.culprits == ()
    assert "too many not halted to be at fault" in replan.reason
    few = ReplanWatch(ChurnConfig(halt_timeout_s=5)).check(plan, PEERS[:6], {p: halted(0) for p in (A, B, C, D)},
                                                          steps=10, checkpoints=[], now=0.0, absent=[E, F])
    assert few.members == (A, B, C, D) and few.culprits == (E, F)  # two of six: theirs
