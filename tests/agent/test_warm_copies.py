"""Liveness and warm copies, the pure parts and the state store: when a peer is dead, when an epoch halts,
who keeps each stage's copy and how often, restarts from copies, the records that carry them, the store's
disk copies, and a copy sent and verified over a real loopback transport."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest
import torch

from p2ptrain.agent.churn.liveness import (
    NO_SHOW_INTERVALS,
    STALL_PACE,
    PeerHealth,
    StallWatch,
    epoch_failure,
    no_show_window_s,
    no_shows,
    taking_up,
)
from p2ptrain.agent.churn.restart import Holding, copies_of, restart_point
from p2ptrain.agent.churn.stage_state import PART_NUMEL, StateKeeper
from p2ptrain.agent.churn.state_store import StateStore
from p2ptrain.agent.churn.warm_copies import (
    COPY_PART_SHARE,
    MIN_COPY_PART_BYTES,
    BackupReceiver,
    BackupSender,
    copy_part_numel,
    copy_parts,
)
from p2ptrain.agent.config import LivenessConfig
from p2ptrain.agent.leadership.plan_maker import backup_interval, choose_backups
from p2ptrain.errors import ConfigError, PeerTimeoutError, ProtocolError
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.stage import build_stage
from p2ptrain.net.dht.records import NO_BACKUP, PlanRecord, ProgressRecord, RecordError
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.messages import MessageKind, Tag
from p2ptrain.net.transport.status import FAIL, HALT, IDLE, TAKE, TRAIN, PeerStatus
from p2ptrain.runtime.checkpoint import state_tensors
from p2ptrain.runtime.config import TrainConfig

PEERS = sorted(generate_identity().peer_id for _ in range(5))
A, B, C, D, E = PEERS


def plan_of(rows, members=PEERS, **extra) -> PlanRecord:
    members = tuple(sorted(members))
    pipelines = tuple(tuple(members.index(p) for p in row) for row in rows)
    return PlanRecord(epoch=3, membership=members, stages=len(rows[0]), replicas=len(rows), pipelines=pipelines,
                      cost_s=1.0, **extra)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- liveness ---------------------------------------------------------------------------------------------


def test_a_silent_peer_is_dead_after_the_timeout_and_not_before_two_pings():
    clock = Clock()
    health = PeerHealth(timeout_s=6.0, clock=clock)
    health.watch([A, B])
    health.record(A, PeerStatus(TRAIN, 0, 1))
    clock.now += 5.9
    health.record(A, PeerTimeoutError("no answer", peer=A))
    health.record(B, PeerStatus(TRAIN, 0, 1))
    assert health.dead() == frozenset()
    clock.now += 0.2
    assert health.dead() == {A}  # 6.1 s since its last answer
    health.record(A, PeerStatus(TRAIN, 0, 2))
    assert health.dead() == frozenset()  # it answered again
    health.watch([A, B, C])
    clock.now += 60
    assert health.is_dead(A) and not health.is_dead(C)  # C: never pinged yet


def test_a_peer_whose_daemon_is_gone_is_dead_after_three_unreachable_pings():
    clock = Clock()
    health = PeerHealth(timeout_s=6.0, clock=clock)
    health.watch([A])
    health.record(A, PeerStatus(TRAIN, 0, 1))
    for _ in range(2):
        health.record(A, ProtocolError("failed to dial", peer=A))
    assert not health.is_dead(A)
    health.record(A, PeerTimeoutError("no answer", peer=A))  # a hanging dial does not reset the count
    health.record(A, ProtocolError("failed to dial", peer=A))
    assert health.is_dead(A)
    health.forgive()  # our own silence (we were stopped): everyone starts afresh
    assert not health.is_dead(A)


def test_an_epoch_halts_on_a_dead_or_failed_trainer_only():
    plan = plan_of([[A, B], [C, D]])  # E is a spare
    assert epoch_failure(plan, A, dead=[E], statuses={}) is None
    assert "stopped answering" in epoch_failure(plan, A, dead=[D], statuses={})
    assert epoch_failure(plan, E, dead=[D], statuses={}) is None  # a spare has no epoch to halt
    assert "on a failure" in epoch_failure(plan, A, dead=[], statuses={B: PeerStatus(FAIL, 3, 5)})
    # stopping cleanly at a re-plan point, an older epoch's failure, or training a newer epoch: go on
    for status in (PeerStatus(HALT, 3, 5), PeerStatus(FAIL, 2, 5), PeerStatus(TRAIN, 4, 5)):
        assert epoch_failure(plan, A, dead=[], statuses={B: status}) is None


def test_a_trainer_that_answers_but_never_takes_up_the_epoch_is_a_no_show():
    plan = dataclasses.replace(plan_of([[A, B], [C, D]]), epoch=3, start_step=5)  # E is a spare
    assert no_shows(plan, A, {}) == []  # no answer: the heartbeats judge it, not this check
    on_it = {B: PeerStatus(TRAIN, 3, 5), C: PeerStatus(FAIL, 3, 5), D: PeerStatus(IDLE, 3, 7)}  # D: done
    assert no_shows(plan, A, on_it) == []
    on_its_way = {B: PeerStatus(TRAIN, 2, 4), C: PeerStatus(TRAIN, 4, 9)}  # an older epoch toward step 5; newer
    assert no_shows(plan, A, on_its_way) == []
    absent = {B: PeerStatus(IDLE, 0, 0), C: PeerStatus(HALT, 2, 5), D: PeerStatus(IDLE, 3, 5), E: PeerStatus()}
    assert no_shows(plan, A, absent) == [B, C, D]  # idle; halted before it; a spare of epoch 3 in its view
    assert no_shows(plan, B, absent) == [C, D]  # never ourselves


def test_a_trainer_that_says_it_takes_the_epoch_up_is_on_its_way_for_the_longer_allowance():
    plan = dataclasses.replace(plan_of([[A, B], [C, D]]), epoch=3, start_step=5)
    statuses = {B: PeerStatus(TAKE, 3, 5), C: PeerStatus(TAKE, 2, 4), D: PeerStatus(IDLE, 2, 5)}
    assert no_shows(plan, A, statuses) == [C, D]  # taking up an older plan is no way to this one
    assert taking_up(plan, A, statuses) == [B]
    # one that still ends an older epoch it halted (its halted record to publish) is busy on its way too
    ending = {B: PeerStatus(HALT, 2, 5), C: PeerStatus(FAIL, 1, 4), D: PeerStatus(HALT, 3, 5)}
    assert taking_up(plan, A, ending) == [B, C] and no_shows(plan, A, ending) == [B, C]  # D took it up
    assert taking_up(plan, B, statuses) == []  # never ourselves


def test_a_trainer_that_says_it_trains_and_never_sends_is_stalled_at_the_runs_pace():
    plan = dataclasses.replace(plan_of([[A, B], [C, D]]), epoch=3, start_step=5)
    watch = StallWatch(plan, A, since=100.0, floor_s=3.0)
    at = dict.fromkeys([B, C, D], 100.5)
    computing = {B: PeerStatus(TRAIN, 3, 5), C: PeerStatus(TRAIN, 3, 5), D: PeerStatus(TRAIN, 3, 5, waits=B)}
    assert watch.observe(computing, at) == [] and watch.pace_s() is None  # nobody sent: no pace, no verdict
    assert watch.unjudged() == []  # ... and nothing to wait for
    at = dict.fromkeys([B, C, D], 102.0)
    sent = {**computing, C: PeerStatus(TRAIN, 3, 5, sent=2)}  # C's first message went out 2 s after we took up
    assert watch.observe(sent, at) == [] and watch.pace_s() == STALL_PACE * 2.0
    for t in (105.0, 108.4):  # B has waited on nobody with nothing sent since 100.5: 8 s allowed
        assert watch.observe(sent, dict.fromkeys([B, C, D], t)) == []
    assert watch.unjudged() == [B]  # its time runs: a leader re-planning waits for its own verdict
    assert watch.observe(sent, dict.fromkeys([B, C, D], 108.6)) == [B]  # D waits on B: not stalled itself
    # one that waits on a neighbour, or sent something, starts afresh
    assert watch.observe({**sent, B: PeerStatus(TRAIN, 3, 5, waits=C)}, dict.fromkeys([B, C, D], 109.0)) == []
    assert watch.observe(sent, dict.fromkeys([B, C, D], 110.0)) == []
    # a status of another epoch, or a halt, is no stall
    assert watch.observe({**sent, B: PeerStatus(HALT, 3, 5)}, dict.fromkeys([B, C, D], 130.0)) == []
    assert StallWatch(plan, A, 100.0, floor_s=3.0).observe({B: PeerStatus(TRAIN, 2, 5)}, {B: 200.0}) == []


def test_the_no_show_window_follows_the_control_plane():
    # a leader's grace (our slowest recent reads) and the answer's age; at least three heartbeat intervals
    assert no_show_window_s(1.0, grace_s=3.0, poll_s=1.0, taking_s=12.0) == 5.0
    assert no_show_window_s(1.0, grace_s=0.5, poll_s=0.5, taking_s=12.0) == NO_SHOW_INTERVALS * 1.0
    assert no_show_window_s(1.0, grace_s=40.0, poll_s=1.0, taking_s=12.0) == 12.0  # never more than a busy peer


def test_liveness_settings_are_checked():
    with pytest.raises(ConfigError, match="two pings"):
        LivenessConfig(interval_s=5.0, timeout_s=6.0)
    with pytest.raises(ConfigError):
        LivenessConfig(ping_timeout_s=0)


# ---- who keeps the copies, how often ------------------------------------------------------------------------


def test_copies_go_outside_the_stage_spares_first_and_fastest():
    # 2 stages x 1 replica on devices 0 and 1; spares 2 and 3; device 3 has the faster link from 0
    copy_s = np.full((4, 4), 10.0)
    copy_s[0, 3], copy_s[0, 2], copy_s[1, 2], copy_s[1, 3] = 1.0, 2.0, 1.0, 3.0
    assert choose_backups([[0], [1]], [0, 1, 2, 3], [2, 3], copy_s) == [3, 2]
    # no spares: the other stage's trainers (each takes its share)
    assert choose_backups([[0, 2], [1, 3]], [0, 1, 2, 3], [], copy_s) in ([1, 0], [3, 0], [1, 2], [3, 2])
    got = choose_backups([[0, 2], [1, 3]], [0, 1, 2, 3], [], copy_s)
    assert got[0] in (1, 3) and got[1] in (0, 2)
    assert choose_backups([[0, 1]], [0, 1], [], copy_s) == [None]  # nobody outside the stage


def test_a_copy_avoids_the_link_that_carries_the_sources_training_messages():
    from p2ptrain.agent.config import ChurnConfig, EmulationSettings
    from p2ptrain.agent.leadership.plan_maker import warm_copies
    from p2ptrain.planning import Cluster, Device

    # 2 stages x 2 replicas, pipelines [0, 1] and [2, 3]: device 0 sends its activations to 1, and 1 its
    # gradients to 0; the fast links 0 → 1 and 1 → 0 carry training, so the copies take the slower ones
    copy_s = np.full((4, 4), 10.0)
    copy_s[0, 1], copy_s[0, 3], copy_s[1, 0], copy_s[1, 2] = 0.5, 4.0, 0.5, 4.0
    groups = [[0, 2], [1, 3]]
    assert choose_backups(groups, [0, 1, 2, 3], [], copy_s) == [1, 0]  # by copy time alone
    assert choose_backups(groups, [0, 1, 2, 3], [], copy_s, busy=[{1}, {0}]) == [3, 2]
    assert choose_backups([[0], [1]], [0, 1], [], copy_s, busy=[{1}, {0}]) == [1, 0]  # nobody else: the neighbour
    # the leader's warm copies name them from the plan's first pipeline
    bandwidth = np.full((4, 4), 1.0)
    bandwidth[0, 1] = bandwidth[1, 0] = 10.0  # the pipeline's own link is the fastest
    cluster = Cluster(tuple(Device(name=f"d{k}") for k in range(4)), np.full((4, 4), 10.0), bandwidth)
    copies = warm_copies({"stages": 2, "pipelines": [[0, 1], [2, 3]]}, ["a", "b", "c", "d"], [], cluster, 100e6,
                         1.0, ChurnConfig(), EmulationSettings())
    assert copies["peers"] == ["d", "c"]


def test_the_interval_keeps_copies_within_their_budget():
    assert backup_interval(copy_s=0.1, step_s=1.0, budget=0.1, max_every=50) == 1
    assert backup_interval(copy_s=1.5, step_s=1.0, budget=0.1, max_every=50) == 15
    assert backup_interval(copy_s=100.0, step_s=1.0, budget=0.1, max_every=50) == 50
    assert backup_interval(copy_s=1.0, step_s=0.0, budget=0.1, max_every=50) == 50


# ---- restarting from copies ---------------------------------------------------------------------------------


def test_a_lost_stage_restarts_from_its_warm_copy_at_a_step_the_others_keep():
    # stage 1's trainers are gone; C keeps a copy of it after step 4; stage 0's trainer keeps 6, 7 and 4
    holdings = {A: [Holding(0, 6, 7), *copies_of([(0, 4)])], C: copies_of([(1, 4)])}
    restart = restart_point(2, holdings)
    assert (restart.step, restart.sources, restart.lost_stages, restart.from_copy) == (4, (A, C), (1,), (0, 1))
    # a trainer's kept state goes before a copy of the same step
    restart = restart_point(2, {A: [Holding(0, 4, 5)], B: copies_of([(0, 5)]), C: [Holding(1, 4, 5)]})
    assert restart.sources == (A, C) and restart.from_copy == ()
    # without the copy: step 0, from the seed
    assert restart_point(2, {A: [Holding(0, 6, 7)]}).step == 0


def test_records_carry_copies_and_backups_and_refuse_bad_ones():
    record = ProgressRecord(3, 7, None, 0.0, halted=True, kept=2, holds=((1, 4), (0, 6), (1, 4)))
    assert record.holds == ((0, 6), (1, 4))
    assert ProgressRecord.decode(record.encode()) == record
    for holds in ([(1,)], [(1, -2)], [("a", 3)], [(0, 1)] * 0 + [(i, i) for i in range(40)]):
        with pytest.raises(RecordError):
            ProgressRecord(3, 7, None, 0.0, holds=holds)
    plan = plan_of([[A, B]], backups=(PEERS.index(C), NO_BACKUP), backup_every=5)
    assert PlanRecord.decode(plan.encode()) == plan
    assert plan.backup_of(0) == C and plan.backup_of(1) is None
    with pytest.raises(RecordError, match="trainer of stage 0"):
        plan_of([[A, B]], backups=(PEERS.index(A), NO_BACKUP))
    with pytest.raises(RecordError, match="one peer per stage"):
        plan_of([[A, B]], backups=(PEERS.index(C),))
    assert plan_of([[A, B]]).backup_of(0) is None  # an older plan without backups


# ---- the store ----------------------------------------------------------------------------------------------


def stage_state(stage: int, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = TrainConfig(model="tiny", stages=2, replicas=1, seed=seed)
    module = build_stage(cfg.shape, stage, 2, seed, torch.device("cpu"))
    optimizer = build_optimizer(module, cfg.optimizer)
    sum(p.square().sum() for p in module.parameters()).backward()
    optimizer.step()  # a state after a step holds AdamW's moments
    return module, state_tensors(module, optimizer)


def test_the_store_serves_kept_states_copies_and_disk_copies_after_a_restart(tmp_path):
    _, own = stage_state(0)
    _, other = stage_state(1, seed=1)
    keeper = StateKeeper(2)
    store = StateStore(keeper, tmp_path, "tiny", 0, keep_copies=2, keep_on_disk=2)
    store.save_own(0, 2, 4, own)
    for step in (3, 5, 8):
        store.add_copy(1, 2, step, other)
    store.flush(30.0)
    assert store.holds(2) == [(0, 4), (1, 5), (1, 8)]  # the two newest copies of a stage, memory and disk
    assert store.get(1, 2, 3) is None
    store.close()
    # a new agent on the same directory (a restart): what is on disk, verified
    again = StateStore(StateKeeper(2), tmp_path, "tiny", 0)
    assert sorted(again.scan_disk(2)) == [(0, 4), (1, 5), (1, 8)]
    loaded = again.get(1, 2, 8)
    assert all(torch.equal(loaded[k], other[k]) for k in other)
    # a tampered file is refused, not served
    data = next((tmp_path / "step-00000005").glob("stage-001*.safetensors"))
    data.write_bytes(data.read_bytes()[:-8] + b"garbage!")
    assert sorted(StateStore(StateKeeper(2), tmp_path, "tiny", 0).scan_disk(2)) == [(0, 4), (1, 8)]
    again.close()


def test_copy_parts_take_a_small_share_of_a_step_on_the_link():
    assert copy_part_numel(None, 1.0) == PART_NUMEL and copy_part_numel(1e6, 0.0) == PART_NUMEL  # unknown
    assert copy_part_numel(100e6, 2.0) == int(100e6 * COPY_PART_SHARE * 2.0) // 4  # 10 MB: 0.1 s of 2 s
    assert copy_part_numel(1e3, 1.0) == MIN_COPY_PART_BYTES // 4  # a slow link: round trips stay small beside
    assert copy_part_numel(1e12, 10.0) == PART_NUMEL
    assert copy_parts(10, 4) == [(0, 4), (4, 8), (8, 10)] and copy_parts(8, 4) == [(0, 4), (4, 8)]
    assert copy_parts(3, PART_NUMEL) == [(0, 3)]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_copy_is_sent_verified_and_kept(tmp_path, caplog):
    from p2ptrain.net.transport.endpoint import Transport, TransportConfig

    module, state = stage_state(1)
    config = TransportConfig(call_timeout_s=30.0)
    with Transport("copytest", config) as a, Transport("copytest", config, initial_peers=a.visible_maddrs) as b:
        store = StateStore(StateKeeper(2), tmp_path, "tiny", 0)
        got = []
        # the window first, as the agent sets it before it starts receiving (``agent.epoch``): a receiver
        # thread that asked before the test moved it was refused epoch 2 as too far ahead and gave up (CI)
        a.set_window("copytest", 2, 0)
        receiver = BackupReceiver(a, store, "copytest", 2, 2, {1: [(str(b.peer_id), 0)]},
                                  lambda stage: build_stage(TrainConfig().shape, stage, 2, 0, torch.device("cpu")),
                                  on_copy=lambda stage, step: got.append((stage, step)), poll_s=0.2).start()
        sender = BackupSender(b, "copytest", 2, 30.0, part_numel=lambda peer: 20_000)  # several parts
        try:
            sender.send(str(a.peer_id), 1, 6, state, module)
            sender.close(wait_s=30.0)
            deadline = time.monotonic() + 30.0
            while not got and time.monotonic() < deadline:
                time.sleep(0.1)
            # a header announcing parts of no elements is refused, and nothing is kept from it
            forged = list((8).to_bytes(8, "little") + bytes(32) + (0).to_bytes(8, "little"))
            with caplog.at_level(logging.WARNING, logger="p2ptrain.agent.churn.warm_copies"):
                b.send(str(a.peer_id), Tag("copytest", 2, 1, MessageKind.BACKUP, 1, 0), torch.tensor(forged, dtype=torch.uint8),
                       30.0)
                deadline = time.monotonic() + 30.0
                while "announces parts of 0 elements; refused" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            receiver.stop()
        assert "announces parts of 0 elements; refused" in caplog.text
        assert got == [(1, 6)] and store.get(1, 2, 8) is None
        kept = store.get(1, 2, 6)
        assert kept is not None and all(torch.equal(kept[k], state[k]) for k in state)
        store.close()


def test_the_leader_prices_a_copy_with_a_round_trip_per_part():
    from p2ptrain.agent.config import ChurnConfig, EmulationSettings
    from p2ptrain.agent.leadership.plan_maker import warm_copies
    from p2ptrain.planning import Cluster, Device

    def copy_s(latency_ms: float, step_s: float) -> float:
        cluster = Cluster(tuple(Device(name=f"d{k}") for k in range(3)), np.full((3, 3), latency_ms),
                          np.full((3, 3), 0.1))  # 12.5 MB/s
        plan = {"stages": 2, "pipelines": [[0, 1]]}
        return warm_copies(plan, ["a", "b"], ["c"], cluster, 100e6, step_s, ChurnConfig(), EmulationSettings())["copy_s"]

    # 100 MB at 12.5 MB/s is 8 s; parts of 5 % of a 10 s step (6.25 MB) make 16 round trips
    assert copy_s(0.0, 10.0) == pytest.approx(8.0)
    assert copy_s(50.0, 10.0) == pytest.approx(8.0 + 0.05 + 16 * 0.1)
    assert copy_s(50.0, 1.0) > copy_s(50.0, 10.0)  # shorter steps: smaller parts, more round trips
