"""One epoch of an agent: follow an accepted plan to the last step (or until stopped).

The plan gives the topology (``pipelines[i][j]``: the peer holding stage j of pipeline i), hence our role,
pipeline neighbours and replica group. We dial them, build the stage exactly as every trainer does
(``runtime.session.StageTrainer``), and run steps; each step publishes a heartbeat (``ProgressRecord``:
epoch, steps done, loss, step time) and logs one line. After the last step we publish the final heartbeat
and wait until every peer of the topology has published its own: a receiver that got all it needs could
otherwise shut its daemon down while the acknowledgement of someone's last message is still on its way.

A spare (a member the plan gives no stage) idles until the trainers' heartbeats say they are done.

Churn (a new membership while training, hence a new epoch, state transfer) is the caller's loop to grow:
``EpochOutcome.finished`` is False when the epoch ended early.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from p2ptrain.agent.events import EventLog
from p2ptrain.errors import ProtocolError
from p2ptrain.net.dht import SwarmDHT
from p2ptrain.net.lifecycle import StopSignal
from p2ptrain.net.records import PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.transport import Transport
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.session import StageTrainer
from p2ptrain.runtime.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochOutcome:
    finished: bool  # every step of the run is done
    steps_done: int
    losses: tuple[float, ...] = ()


def topology_of(plan: PlanRecord) -> Topology:
    return Topology.from_rows(
        [[plan.peer_at(i, j) for j in range(plan.stages)] for i in range(plan.replicas)]
    )


class Heartbeat:
    """Publishes progress records off the training thread; at most one store in flight (a newer
    heartbeat replaces one still waiting), ``flush`` publishes the last one for sure."""

    def __init__(self, dht: SwarmDHT):
        self.dht = dht
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-heartbeat")
        self._pending: concurrent.futures.Future | None = None

    def beat(self, record: ProgressRecord) -> None:
        if self._pending is not None and not self._pending.done():
            return  # the DHT is slow: skip this one rather than queue behind it
        self._pending = self._pool.submit(self._publish, record)

    def flush(self, record: ProgressRecord) -> None:
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
        self._publish(record)

    def _publish(self, record: ProgressRecord) -> None:
        try:
            self.dht.publish_progress(record)
        except ProtocolError as e:
            logger.warning("heartbeat not published: %s", e)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_epoch(
    plan: PlanRecord,
    *,
    me: str,
    train: TrainConfig,
    device: torch.device,
    transport: Transport,
    dht: SwarmDHT,
    peers: dict[str, PeerRecord],
    stop: StopSignal,
    events: EventLog,
    heartbeat: Heartbeat,
    call_timeout_s: float,
    poll_s: float,
    finish_timeout_s: float,
) -> EpochOutcome:
    topology = topology_of(plan)
    cfg = dataclasses.replace(train, stages=plan.stages, replicas=plan.replicas)
    if me not in topology.peers:
        return _idle_as_spare(plan, topology, cfg, dht, stop, events, poll_s)
    role = topology.role_of(me)
    logger.info(
        "epoch %d: stage %d of pipeline %d (%d stages × %d replicas, leader %s, predicted %.3f s/step)",
        plan.epoch, role.stage, role.replica, plan.stages, plan.replicas, plan.leader, plan.cost_s,
    )  # fmt: skip
    events.write("role", epoch=plan.epoch, stage=role.stage, replica=role.replica, stages=plan.stages,
                 replicas=plan.replicas, leader=plan.leader, cost_s=plan.cost_s)
    for peer in sorted(topology.neighbours(role)):
        transport.connect(peer, peers[peer].maddrs if peer in peers else (), call_timeout_s)
    trainer = StageTrainer(cfg, role, device)
    losses: list[float] = []
    done = 0
    for step in range(cfg.steps):
        if stop.is_set():
            return EpochOutcome(False, done, tuple(losses))
        result = trainer.step(transport, dht.keys.run_id, plan.epoch, step, topology, call_timeout_s)
        done = step + 1
        if result.loss is not None:
            losses.append(result.loss)
        record = ProgressRecord(plan.epoch, done, result.loss, result.step_time_s)
        if done == cfg.steps:
            heartbeat.flush(record)  # the others wait for it before they leave
        else:
            heartbeat.beat(record)
        events.write("step", epoch=plan.epoch, step=done, loss=result.loss, step_time_s=result.step_time_s,
                     stage=role.stage, replica=role.replica)
        loss = f" loss {result.loss:.4f}" if result.loss is not None else ""
        logger.info("epoch %d step %d/%d%s (%.3f s)", plan.epoch, done, cfg.steps, loss, result.step_time_s)
    _finish_together(plan, topology, me, cfg.steps, dht, stop, poll_s, finish_timeout_s)
    return EpochOutcome(True, done, tuple(losses))


def _finished_peers(dht: SwarmDHT, epoch: int, steps: int) -> set[str]:
    try:
        progress = dht.read_progress()
    except ProtocolError as e:
        logger.warning("reading progress failed: %s", e)
        return set()
    return {p for p, r in progress.items() if r.epoch == epoch and r.step >= steps}


def _finish_together(
    plan: PlanRecord, topology: Topology, me: str, steps: int, dht: SwarmDHT, stop: StopSignal,
    poll_s: float, timeout_s: float,
) -> None:  # fmt: skip
    waiting = set(topology.peers) - {me}
    deadline = time.monotonic() + timeout_s
    while waiting and not stop.is_set() and time.monotonic() < deadline:
        waiting -= _finished_peers(dht, plan.epoch, steps)
        if waiting:
            stop.wait(min(poll_s, 0.25))
    if waiting and not stop.is_set():
        logger.warning("leaving before %d trainer(s) said they were done: %s", len(waiting), ", ".join(sorted(waiting)))


def _idle_as_spare(
    plan: PlanRecord, topology: Topology, cfg: TrainConfig, dht: SwarmDHT, stop: StopSignal, events: EventLog,
    poll_s: float,
) -> EpochOutcome:  # fmt: skip
    logger.info("epoch %d: spare (the plan uses %d of %d members); waiting for the trainers to finish",
                plan.epoch, len(topology.peers), len(plan.membership))
    events.write("role", epoch=plan.epoch, stage=None, replica=None, stages=plan.stages, replicas=plan.replicas,
                 leader=plan.leader, cost_s=plan.cost_s)
    while not stop.wait(poll_s):
        if set(topology.peers) <= _finished_peers(dht, plan.epoch, cfg.steps):
            logger.info("the trainers finished all %d steps", cfg.steps)
            return EpochOutcome(True, 0)
    return EpochOutcome(False, 0)
