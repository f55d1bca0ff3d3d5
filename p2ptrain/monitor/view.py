"""What the monitor knows about a run: successive snapshots of its verified DHT records folded into one view.

Pure (no I/O, no clock: every snapshot carries the time it was read), so it is tested on hand-made records::

    view = RunView(ViewConfig(run="demo", tokens_per_step=4096))
    view.update(Snapshot(time=t, peers=..., links=..., plans=..., progress=...))
    view.state()   # the JSON document of /api/state

A DHT-only observer sees each peer's *latest* heartbeat, not a log: it samples. A step shorter than the poll
interval may be missed (the curves then join the steps that were seen), and the curves start when the
monitor did. Joins and leaves are peer records appearing and expiring; re-plans are the current plan's epoch
rising. The current plan is the one signed by the lowest live peer (``leadership.election``); before that peer has
planned, the newest plan by a live signer.

Traffic and utilisation come from each live peer's latest training heartbeat (not halted, of the newest epoch
among them): the bytes it sent in that step (``ProgressRecord.sent_bytes``) and its compute utilisation,
its own compute over the step's time (``compute_s / step_time_s``; none where compute was not measured), and
the run's MFU as it saw the step (``ProgressRecord.mfu``; the summary's is their mean). Each peer's control
plane a minute is its latest heartbeat's (``ProgressRecord.traffic``: DHT calls, their kB, pings' and probes' kB).
The run's sync mode is the steps between data-parallel syncs those heartbeats state (``sync_every``, H of
DiLoCo's rounds; 1: every step), the most of them agreeing; its current round is the highest step seen // H.

Every string in a record came from a peer and is untrusted: the view passes it on unchanged, as data; the
server encodes it so that no HTML survives in the bytes it sends, and the page only ever sets it as text.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.net.dht.records import TRAFFIC_FIELDS, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.nat.relay import is_circuit


@dataclass(frozen=True)
class ViewConfig:
    run: str
    tokens_per_step: int | None = None  # global batch × sequence length: turns step times into tokens/s
    # an emulated network (``p2ptrain swarm --scenario``): the plan's seconds are the network's, this many
    # network seconds per real second; measured links are shown in the network's units (as the leader plans)
    time_scale: float = 1.0
    size_factor: float = 1.0
    emulated: bool = False
    silent_after_s: float = 30.0  # a trainer whose heartbeat has not moved for this long is shown as silent
    max_points: int = 10_000  # steps kept in the series (the oldest go first)
    max_events: int = 1_000
    max_link_peers: int = 128  # the heat maps' side: N² cells go to the page every poll (plan members first)


@dataclass(frozen=True)
class Snapshot:
    """The run's verified records, by writer's peer ID, as read at ``time`` (unix seconds)."""

    time: float
    peers: Mapping[str, PeerRecord]
    links: Mapping[str, LinksRecord] = field(default_factory=dict)
    plans: Mapping[str, PlanRecord] = field(default_factory=dict)
    progress: Mapping[str, ProgressRecord] = field(default_factory=dict)


@dataclass
class _Peer:
    first_seen: float
    record: PeerRecord | None = None
    left_at: float | None = None
    progress: ProgressRecord | None = None
    beat_at: float | None = None  # when its heartbeat last changed (the monitor's clock)


@dataclass
class _Step:
    epoch: int
    loss: float | None = None
    times: dict[str, float] = field(default_factory=dict)  # peer -> its step time


def current_plan(plans: Mapping[str, PlanRecord], live: Iterable[str]) -> PlanRecord | None:
    """The plan the run follows: the lowest live peer's, else the newest by a live signer, else the newest."""
    live = set(live)
    leader = min(live, default=None)
    if leader in plans:
        return plans[leader]
    candidates = [plan for signer, plan in plans.items() if signer in live] or list(plans.values())
    return max(candidates, key=lambda plan: plan.epoch, default=None)


class RunView:
    def __init__(self, config: ViewConfig):
        self.config = config
        self._peers: dict[str, _Peer] = {}
        self._links: dict[str, LinksRecord] = {}
        self._plan: PlanRecord | None = None
        self._plan_costs: dict[int, float] = {}  # epoch -> predicted cost per step (the plan's seconds)
        self._steps: dict[int, _Step] = {}
        self._events: list[dict[str, Any]] = []
        self._counts = {"join": 0, "leave": 0, "plan": 0}
        self._events_total = 0  # events ever, also those dropped past max_events
        self._updated: float | None = None
        self.polls = 0

    # ---- folding snapshots in ---------------------------------------------------------------------------

    def update(self, snap: Snapshot) -> None:
        first = self._updated is None
        self._updated = snap.time
        self.polls += 1
        if first:
            self._event(snap.time, "start", None, f"monitor started; {len(snap.peers)} peers present")
        for peer_id, record in snap.peers.items():
            peer = self._peers.get(peer_id)
            if peer is None or peer.left_at is not None:
                if not first:
                    again = " again" if peer is not None else ""
                    self._event(snap.time, "join", peer_id, f"joined{again}: {record.device_name}")
                if peer is None:
                    peer = self._peers[peer_id] = _Peer(first_seen=snap.time)
                peer.left_at = None
            peer.record = record
        for peer_id, peer in self._peers.items():
            if peer.left_at is None and peer.record is not None and peer_id not in snap.peers:
                peer.left_at = snap.time
                self._event(snap.time, "leave", peer_id, "left (its peer record expired)")
        for peer_id, record in snap.progress.items():
            self._beat(snap.time, peer_id, record)
        self._links.update(snap.links)  # a row stays as last measured once its writer has gone
        self._follow_plan(snap.time, current_plan(snap.plans, snap.peers))
        self._prune()

    def _beat(self, now: float, peer_id: str, record: ProgressRecord) -> None:
        peer = self._peers.setdefault(peer_id, _Peer(first_seen=now))
        old = peer.progress
        if old is None or (old.epoch, old.step, old.halted) != (record.epoch, record.step, record.halted):
            peer.beat_at = now
            if record.halted and record.evidence and record.blame is not None:  # a check of its work failed
                self._event(now, "verify_failed", record.blame, f"failed a check of its work in epoch {record.epoch}: "
                            f"blamed with evidence by {peer_id}", epoch=record.epoch)
        peer.progress = record
        if record.step == 0 or record.halted:
            return
        step = self._steps.get(record.step)
        if step is None or step.epoch < record.epoch:  # a step redone after a re-plan replaces the old one
            step = self._steps[record.step] = _Step(record.epoch)
        elif step.epoch > record.epoch:
            return  # a late heartbeat of an older epoch
        if record.loss is not None:
            step.loss = record.loss
        if record.step_time_s > 0:
            step.times[peer_id] = record.step_time_s

    def _follow_plan(self, now: float, plan: PlanRecord | None) -> None:
        if plan is None:
            return
        old = self._plan
        self._plan = plan
        self._plan_costs[plan.epoch] = plan.cost_s
        if old is not None and (plan.epoch, plan.leader) == (old.epoch, old.leader):
            return
        if old is not None and plan.epoch < old.epoch and plan.leader == old.leader:
            return
        why = f" ({plan.reason})" if plan.reason else ""
        text = (f"plan epoch {plan.epoch}{why}: {plan.stages} stages × {plan.replicas} pipelines, "
                f"{len(plan.membership)} members, from step {plan.start_step}, "
                f"predicted {self._predicted_s(plan.cost_s):.3f} s/step")
        self._event(now, "plan", plan.leader, text, epoch=plan.epoch, step=plan.start_step)

    def _event(self, now: float, kind: str, peer: str | None, text: str, **extra: Any) -> None:
        if kind in self._counts:
            self._counts[kind] += 1
        extra.setdefault("step", max(self._steps, default=0))  # where the charts mark it
        self._events.append({"time": now, "kind": kind, "peer": peer, "text": text, **extra})
        self._events_total += 1

    def _prune(self) -> None:
        del self._events[: max(0, len(self._events) - self.config.max_events)]
        for step in sorted(self._steps)[: max(0, len(self._steps) - self.config.max_points)]:
            del self._steps[step]

    def _predicted_s(self, cost_s: float) -> float:
        """A plan's predicted step in real seconds (an emulated network's seconds run time_scale faster)."""
        return cost_s * self.config.time_scale

    # ---- the JSON document ------------------------------------------------------------------------------

    def state(self, now: float | None = None) -> dict[str, Any]:
        now = self._updated if now is None else now
        cfg = self.config
        series = self._series()
        times = [t for _, t in series["step_time_s"][-5:]]
        step_s = statistics.median(times) if times else None
        alive = [p for p in self._peers.values() if p.left_at is None and p.record is not None]
        step = max(self._steps, default=0)
        return {
            "run": cfg.run, "time": now, "polls": self.polls, "last_read": self._updated,
            "emulation": {"time_scale": cfg.time_scale, "size_factor": cfg.size_factor} if cfg.emulated else None,
            "tokens_per_step": cfg.tokens_per_step,
            "summary": {
                "peers_alive": len(alive), "peers_seen": len(self._peers),
                "epoch": self._plan.epoch if self._plan else None,
                "leader": self._plan.leader if self._plan else None,
                "step": step,
                "loss": series["loss"][-1][1] if series["loss"] else None,
                "step_time_s": step_s,
                "tokens_per_s": cfg.tokens_per_step / step_s if cfg.tokens_per_step and step_s else None,
                "predicted_step_s": self._predicted_s(self._plan.cost_s) if self._plan else None,
                "replans": max(0, self._counts["plan"] - 1), "joins": self._counts["join"],
                "leaves": self._counts["leave"], **self._sync_state(step),
            },
            "peers": [self._peer_state(peer_id, now) for peer_id in self._peer_order()],
            "links": self._link_matrix(),
            "plan": self._plan_state(),
            "series": series,
            "events": list(self._events), "events_total": self._events_total,
        }

    def _peer_order(self) -> list[str]:
        """Plan members in plan order (pipeline by pipeline), then the others by peer ID."""
        ordered: list[str] = []
        if self._plan is not None:
            plan = self._plan
            ordered = [plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)]
            ordered += [p for p in plan.membership if p not in ordered]
        return ordered + sorted(p for p in self._peers if p not in ordered)

    def _peer_state(self, peer_id: str, now: float | None) -> dict[str, Any]:
        peer = self._peers.get(peer_id) or _Peer(first_seen=now or 0.0)
        record, progress = peer.record, peer.progress
        role = self._role(peer_id)
        age = now - peer.beat_at if now is not None and peer.beat_at is not None else None
        if peer.left_at is not None or record is None:
            liveness = "left" if peer.left_at is not None else "unknown"
        elif (progress is not None and progress.halted and role["kind"] != "spare"
              and (self._plan is None or progress.epoch >= self._plan.epoch)):
            # waiting for the next plan; a halt of an older epoch is over once a plan came, and a spare's
            # heartbeat always says halted (it idles, keeping states for the leader)
            liveness = "halted"
        elif role["kind"] == "trainer" and age is not None and age > self.config.silent_after_s:
            liveness = "silent"
        else:
            liveness = {"trainer": "training", "spare": "spare"}.get(role["kind"], "waiting")
        out: dict[str, Any] = {
            "peer_id": peer_id, "liveness": liveness, "role": role,
            "leader": self._plan is not None and self._plan.leader == peer_id,
            "first_seen": peer.first_seen, "left_at": peer.left_at,
            "last_heartbeat": peer.beat_at, "heartbeat_age_s": age,
            "epoch": progress.epoch if progress else None, "step": progress.step if progress else None,
            "loss": progress.loss if progress else None, "step_time_s": progress.step_time_s if progress else None,
            "sent_bytes": progress.sent_bytes if progress else None,
            "utilisation": _utilisation(progress) if progress else None,
            "mfu": progress.mfu if progress and not progress.halted else None,
            # its control plane a minute (``ProgressRecord.traffic``): DHT calls, their kB, pings' and probes' kB
            "traffic": dict(zip(TRAFFIC_FIELDS, progress.traffic, strict=True)) if progress and progress.traffic else None,
        }
        if record is not None:
            out.update({
                "device_name": record.device_name, "region": record.region, "memory_gb": record.memory_gb,
                "tflops": record.tflops, "calibrated": record.compute is not None,
                "address": "relayed" if any(is_circuit(m) for m in record.maddrs) else "direct",
                "maddrs": list(record.maddrs), "version": record.p2ptrain_version,
                "protocol": record.protocol_version, "emulated_device": record.emulated_device,
            })
        return out

    def _training_beats(self) -> list[ProgressRecord]:
        """Live peers' latest heartbeats that report a step trained (not halted), of the newest epoch among them."""
        beats = [p.progress for p in self._peers.values() if p.left_at is None and p.record is not None
                 and p.progress is not None and not p.progress.halted and p.progress.step > 0]
        newest = max((b.epoch for b in beats), default=None)
        return [b for b in beats if b.epoch == newest]

    def _sync_state(self, step: int) -> dict[str, Any]:
        """The summary's sync mode, round, traffic and utilisation (see the module docstring)."""
        beats = self._training_beats()
        votes = Counter(b.sync_every for b in beats)
        every = max(votes, key=lambda h: (votes[h], -h), default=None)  # ties: the more frequent sync
        diloco = every is not None and every > 1
        sent = [b.sent_bytes for b in beats if b.sent_bytes is not None]
        used = [u for b in beats if (u := _utilisation(b)) is not None]
        mfus = [b.mfu for b in beats if b.mfu is not None]
        return {
            "sync": None if every is None else "diloco" if diloco else "every-step", "sync_every": every,
            "round": step // every if diloco else None,
            "round_steps_left": every - step % every if diloco else None,
            "sent_bytes_per_step": sum(sent) if sent else None,
            "utilisation": statistics.fmean(used) if used else None,
            "mfu": statistics.fmean(mfus) if mfus else None,
        }

    def _role(self, peer_id: str) -> dict[str, Any]:
        plan = self._plan
        if plan is None or peer_id not in plan.membership:
            return {"kind": "none"}
        position = plan.position_of(peer_id)
        if position is not None:
            return {"kind": "trainer", "pipeline": position[0], "stage": position[1]}
        return {"kind": "spare", "backup_of": [j for j in range(plan.stages) if plan.backup_of(j) == peer_id]}

    def _link_matrix(self) -> dict[str, Any]:
        order = self._peer_order()[: self.config.max_link_peers]
        cfg = self.config
        latency, bandwidth = [], []
        for writer in order:
            row = self._links.get(writer)
            measured = row.resolve(order) if row is not None else {}
            latency.append([None if (m := measured.get(p)) is None else m.latency_ms / cfg.time_scale for p in order])
            bandwidth.append([None if (m := measured.get(p)) is None else m.bandwidth_gbps * cfg.time_scale
                              / cfg.size_factor for p in order])
        units = "the emulated network's (as the leader plans)" if cfg.emulated else "measured"
        # per peer, its links measured by either end, and the others: estimated by the planner (``planning.estimated``)
        measured = [sum(1 for j in range(len(order)) if j != i and (latency[i][j] is not None or latency[j][i] is not None))
                    for i in range(len(order))]
        return {"peers": order, "latency_ms": latency, "bandwidth_gbps": bandwidth, "units": units,
                "measured": measured, "estimated": [len(order) - 1 - m for m in measured]}

    def _plan_state(self) -> dict[str, Any] | None:
        plan = self._plan
        if plan is None:
            return None
        spares = [p for p in plan.membership if plan.position_of(p) is None]
        return {
            "epoch": plan.epoch, "leader": plan.leader, "stages": plan.stages, "replicas": plan.replicas,
            "pipelines": [[plan.peer_at(i, j) for j in range(plan.stages)] for i in range(plan.replicas)],
            "spares": spares, "backups": [plan.backup_of(j) for j in range(plan.stages)] if plan.backups else [],
            "objective": plan.objective, "cost_s": plan.cost_s, "data_parallel_s": plan.data_parallel_s,
            "pipeline_s": plan.pipeline_s, "predicted_step_s": self._predicted_s(plan.cost_s),
            "baselines": dict(plan.baselines), "start_step": plan.start_step, "reason": plan.reason,
        }

    def _series(self) -> dict[str, list[list[float]]]:
        loss, step_time, tokens, predicted = [], [], [], []
        per_step = self.config.tokens_per_step
        for step in sorted(self._steps):
            entry = self._steps[step]
            if entry.loss is not None:
                loss.append([step, entry.loss])
            if entry.times:
                seconds = statistics.median(entry.times.values())
                step_time.append([step, seconds])
                if per_step:
                    tokens.append([step, per_step / seconds])
            if entry.epoch in self._plan_costs:
                predicted.append([step, self._predicted_s(self._plan_costs[entry.epoch])])
        return {"loss": loss, "step_time_s": step_time, "tokens_per_s": tokens, "predicted_step_s": predicted}


def _utilisation(progress: ProgressRecord) -> float | None:
    """The share of its step a peer computed (``compute_s / step_time_s``); None for a halted heartbeat or
    one without a measured compute or step time."""
    if progress.halted or progress.compute_s <= 0 or progress.step_time_s <= 0:
        return None
    return progress.compute_s / progress.step_time_s
