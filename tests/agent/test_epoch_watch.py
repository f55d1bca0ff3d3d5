"""The heartbeats' watch of the epoch followed (``agent.epoch_watch``): its findings, and its shared fields under
the three threads that use them at once (the main thread taking epochs up, the liveness thread's rounds, the
step-boundary thread cutting a step short)."""

from __future__ import annotations

import random
import threading
import time

from p2ptrain.agent.config import LivenessConfig
from p2ptrain.agent.epoch_watch import EpochWatch
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.status import IDLE, TRAIN, PeerStatus

PEERS = sorted(generate_identity().peer_id for _ in range(4))
A, B, C, D = PEERS


def plan_of(epoch: int) -> PlanRecord:
    return PlanRecord(epoch=epoch, membership=tuple(PEERS), stages=2, replicas=2, pipelines=((0, 1), (2, 3)),
                      cost_s=1.0)


class Heartbeats:
    """What a heartbeat round leaves for the watch (``LivenessMonitor``'s answers), set by the test."""

    def __init__(self):
        self.dead_peers: set[str] = set()
        self.status: dict[str, PeerStatus] = {}
        self.when: dict[str, float] = {}
        self.silence_s = 0.0

    def take_silence(self) -> float:
        return self.silence_s

    def answered(self) -> dict[str, float]:
        return dict(self.when)

    def statuses(self) -> dict[str, PeerStatus]:
        return dict(self.status)

    def dead(self) -> set[str]:
        return set(self.dead_peers)


class Aborts:
    def __init__(self):
        self.calls: list[tuple[int, str, str | None, bool]] = []
        self._lock = threading.Lock()

    def __call__(self, epoch: int, reason: str, *, culprit: str | None = None, failure: bool = True) -> None:
        with self._lock:
            self.calls.append((epoch, reason, culprit, failure))


def test_a_dead_trainer_aborts_the_epoch_once_naming_it_and_a_step_boundary_finds_it_aborted():
    aborts, beats = Aborts(), Heartbeats()
    watch = EpochWatch(A, LivenessConfig(), aborts)
    plan = plan_of(3)
    watch.on_round(plan, beats)  # not taken up yet: nothing to abort
    watch.begin(plan, taking_after_s=10.0, no_show_after_s=5.0)
    watch.on_round(plan, beats)  # everyone alive
    assert aborts.calls == [] and watch.aborted == -1
    beats.dead_peers = {C}
    watch.on_round(plan, beats)
    watch.on_round(plan, beats)  # the next round finds it aborted already
    assert aborts.calls == [(3, f"peer(s) {C} stopped answering heartbeats", C, True)]
    assert watch.aborted == 3
    assert not watch.abort_first(3, "a newer plan starts after step 2", failure=False)
    watch.end()
    assert watch.training is None


def test_a_trainer_that_stays_idle_past_its_time_is_seen_and_said_to_the_leader():
    aborts, beats = Aborts(), Heartbeats()
    watch = EpochWatch(A, LivenessConfig(), aborts)
    plan = plan_of(1)
    watch.begin(plan, taking_after_s=0.0, no_show_after_s=0.0)
    beats.status = {B: PeerStatus(TRAIN, 1, 0), C: PeerStatus(IDLE, 0, 0), D: PeerStatus(TRAIN, 1, 0)}
    beats.when = {p: float("inf") for p in (B, C, D)}  # answers that came long after we took the epoch up
    watch.on_round(plan, beats)
    assert watch.seen(1)[0] == (C,)
    assert watch.seen(0) == ((), ())  # another epoch's: nothing
    assert [(e, culprit) for e, _, culprit, _ in aborts.calls] == [(1, C)]


def test_the_threads_that_share_the_watch_abort_each_epoch_at_most_once():
    # the main thread takes 200 epochs up one after another; the liveness thread's rounds find a dead trainer
    # at random; the step-boundary thread cuts the epoch being trained short at random; a reader reads what
    # the leader would. Every epoch is aborted at most once, in order, and only once taken up.
    aborts, beats = Aborts(), Heartbeats()
    watch = EpochWatch(A, LivenessConfig(), aborts)
    epochs = 200
    current: list[PlanRecord | None] = [None]
    taken: set[int] = set()
    done = threading.Event()
    errors: list[BaseException] = []

    def guarded(body):
        def run():
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
        return run

    turns = {"liveness": 0, "boundary": 0}  # each thread's iterations, so every epoch sees both threads

    def main():
        for epoch in range(epochs):
            plan = plan_of(epoch)
            taken.add(epoch)
            watch.begin(plan, taking_after_s=10.0, no_show_after_s=5.0)
            current[0] = plan
            seen_at = dict(turns)
            deadline = time.monotonic() + 30.0
            while any(turns[k] < seen_at[k] + 2 for k in turns) and time.monotonic() < deadline:
                watch.seen(epoch)
                time.sleep(0)
            watch.end()
        done.set()

    def liveness():
        rng = random.Random(1)
        while not done.is_set():
            beats.dead_peers = {C} if rng.random() < 0.3 else set()
            watch.on_round(current[0], beats)
            turns["liveness"] += 1

    def boundary():
        rng = random.Random(2)
        while not done.is_set():
            training = watch.training
            if training is not None and rng.random() < 0.3:
                watch.abort_first(training, "a newer plan starts after this step", failure=False)
            turns["boundary"] += 1

    def reader():
        while not done.is_set():
            assert watch.aborted <= epochs
            plan = current[0]
            if plan is not None:
                watch.seen(plan.epoch)

    threads = [threading.Thread(target=guarded(f)) for f in (main, liveness, boundary, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    aborted = [epoch for epoch, *_ in aborts.calls]
    assert aborted == sorted(set(aborted)), "an epoch aborted twice, or out of order"
    assert set(aborted) <= taken
    assert aborted, "no thread found a reason to abort: the stress test exercised nothing"
