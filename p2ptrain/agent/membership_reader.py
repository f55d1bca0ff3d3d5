"""Who is live, read every poll: the verified peer records, their claims bounded, the dead left out.

    reader = MembershipReader(config, peer_id, tracker, dht, transport, prober, liveness, leaders, shaping, events)
    seen, membership = reader.read(following)  # None where the records could not be read

Each read takes the run's peer records (``leadership.membership.MembershipTracker``: compatible data and
settings), keeps the peers whose claims a real device could make, their TFLOP/s bounded by their calibration
(``leadership.claims``: a pure function of each record, so every agent's view agrees), leaves out the peers
the heartbeats found dead, orders them by standing (``leadership.standing``; ``seen``) and leaves out the
leaders passed over (``membership``). New peers are dialled by address and their links shaped when
emulating (``shaping.LinkShaping``); our partners among them (``leadership.probe_set``: the probe graph's, our
neighbours in the plan we follow) known for ``links.settle_s`` go to the link prober. It tells
the heartbeats whom to ping: every member in a small run, beyond ``liveness.watch_all_up_to`` the peers of our
pipeline neighbours, O(log) of our replica group (``group_fingers``), the leader and the next in line (who watch
everyone).

What a read costs grows with the run (a record a peer). In a run of n members beyond
``membership.read_all_up_to`` (r), an agent that is neither the leader nor the next in line reads the peer
records every n / r polls, at most every ``dht.peer_ttl_s`` (``spacing``; the poll in between works on the last
records read, with the heartbeats' verdicts applied afresh), and at once when a plan newer than any it saw
appears (``behind``: a plan is checked against a fresh view). The leader and the next in line read every poll.
So a follower's bytes a minute stay those of a run of r peers until the lifetime cap (about 16 × 60 peers at the
defaults), and the few DHT nodes that hold the run's peer records are not asked n times a poll.

Fewer still while nothing changes: every agent says in its heartbeat answers a digest of the records it read
last (``PeerStatus.peers``), and a follower whose leader answers in time reads the records when the leader's digest
is not its own (a join, a record expired or replaced: the leader read it within a poll), and otherwise every
``PEERS_READ_S`` times the spacing (``_due``). An idle run of n agents then makes a few reads a second, not n.

Used by the poller alone (the agent's main thread, or its step-boundary thread while an epoch trains: one at
a time; ``agent`` says how), so its fields need no lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from p2ptrain.agent.churn.liveness import LivenessMonitor
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.events import EventLog, TrafficReport
from p2ptrain.agent.leadership import probe_set
from p2ptrain.agent.leadership.checkers import checkers
from p2ptrain.agent.leadership.claims import bounded, record_problem
from p2ptrain.agent.leadership.membership import Membership, MembershipTracker
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.links import LinkProber
from p2ptrain.agent.shaping import LinkShaping
from p2ptrain.errors import ProtocolError
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.records import PeerRecord, PlanRecord
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.status import peers_digest

logger = logging.getLogger(__name__)

PEERS_READ_S = 5.0  # a follower whose leader read the records it read reads them again this often (× spacing)
READ_EARLY = 0.9  # a read is due this fraction into its period: a poll that comes a little early does not skip it


class MembershipReader:
    """An agent's reads of who is live (module docstring); ``liveness`` None where heartbeats are off."""

    def __init__(self, config: AgentConfig, peer_id: str, tracker: MembershipTracker, dht: SwarmDHT,
                 transport: Transport, prober: LinkProber, liveness: LivenessMonitor | None, leaders: LeaderWatch,
                 shaping: LinkShaping, events: EventLog):
        self.config, self.peer_id, self.dht, self.transport, self.events = config, peer_id, dht, transport, events
        self._tracker, self.prober, self.liveness, self._leaders = tracker, prober, liveness, leaders
        self._shaping = shaping
        self._dialled: set[str] = set()
        self._claims_noted: set[tuple[str, str]] = set()  # (peer, what was said): each said once
        self._traffic = TrafficReport(events, dht.counters, transport.counters)  # the ``dht_traffic`` events
        self._records: dict[str, PeerRecord] | None = None  # the last peer records read, and when
        self._read_at = -float("inf")
        self._first_two: set[str] = set()  # the leader and the next in line at the last read
        self._leader: str | None = None  # ... the leader, whose digest of the records (``PeerStatus.peers``) we follow
        self._digest = -1  # the digest of the records we read last (``status.peers_digest``)
        self._newest_epoch = -1  # the newest plan ``behind`` was told of
        self.watched: set[str] | None = None  # whom the heartbeats ping (None: liveness off): ``PlanGate.left_out``

    def read(self, following: PlanRecord | None, force: bool = False) -> tuple[Membership, Membership] | None:
        """The live members, with the passed-over leaders and without (None if the records could not be read:
        the last view stands); the new ones dialled and shaped, the settled ones handed to the prober.
        ``following``: the plan this agent follows (whom the heartbeats watch); the records are read if due
        (``spacing``) or ``force``d, else the last ones read are used."""
        tracker = self._tracker
        self._traffic.maybe()
        if force or self._records is None or self._due(self.spacing(following)):
            try:
                self._records, self._read_at = self.dht.read_peers(), time.monotonic()
            except ProtocolError as e:
                logger.warning("reading the peer records failed: %s; keeping the last view", e)
                return None
            self._digest = peers_digest(self._records)
            self.transport.announced.peers = self._digest  # our ping answers say it (``PeerStatus.peers``)
        membership = self._checked_claims(tracker.update(self._records))
        partners = probe_set.partners(self.peer_id, membership.peers, self.config, following)
        if self.liveness is not None:
            self.watched = self._watch_targets(membership, following, partners)
            self.liveness.watch(self.watched)
            dead = self.liveness.dead()
            membership = Membership({p: r for p, r in membership.peers.items() if p not in dead or p == self.peer_id})
        seen = Membership(membership.peers, self._leaders.standing)  # who leads: ``leadership.standing``
        membership = seen.without(*(self._leaders.excluded() - {self.peer_id}))
        leader = membership.leader
        self._first_two = {p for p in (leader, membership.without(leader).leader) if p is not None} if leader else set()
        self._leader = leader
        for peer, record in membership.peers.items():
            if peer != self.peer_id:
                self._shaping.shape_link(peer, record)
        self._dial({p: r.maddrs for p, r in membership.peers.items() if p != self.peer_id and p not in self._dialled})
        self.prober.set_peers(
            p for p in partners if p in self._dialled and tracker.known_for_s(p) >= self.config.links.settle_s
        )
        return seen, membership

    def _dial(self, new: dict[str, Any]) -> None:
        """Dial the peers not dialled yet (peer -> its maddrs), all at once; one that cannot be reached is tried
        again at the next read."""
        if not new:
            return
        try:
            errors = self.transport.connect_all(new, self.config.links.connect_timeout_s)
        except Exception as e:  # the daemon raises its own error types; a shut transport, a loop past its deadline
            errors = dict.fromkeys(new, e)
        for peer, error in errors.items():
            if error is None:
                self._dialled.add(peer)
            else:
                logger.warning("cannot dial peer %s at %s: %s; retrying", peer, " ".join(new[peer]), error)

    def _due(self, spacing: float) -> bool:
        """Whether the peer records are read this poll (module docstring): every ``spacing`` polls by the leader,
        the next in line and agents without heartbeats, or while the leader's answers are late; by the others when
        the leader's digest of the records it read (``PeerStatus.peers``) is not that of ours, and at least every
        ``PEERS_READ_S`` (times ``spacing``)."""
        now, cfg = time.monotonic(), self.config
        period = min(cfg.membership.poll_s * spacing, cfg.dht.peer_ttl_s)
        usual = spacing == 1.0 or now - self._read_at >= period * READ_EARLY
        if self.liveness is None or self._leader is None or self.peer_id in self._first_two:
            return usual
        status, answered = self.liveness.statuses().get(self._leader), self.liveness.answered().get(self._leader)
        if status is None or answered is None or status.peers < 0 or \
                now - answered > 2 * cfg.liveness.interval_s + cfg.liveness.ping_timeout_s:
            return usual
        return status.peers != self._digest or now - self._read_at >= min(PEERS_READ_S * spacing, cfg.dht.peer_ttl_s)

    def spacing(self, following: PlanRecord | None) -> float:
        """How many times its usual period a read of every peer's (or progress) record waits: n / r for an
        agent in a run of n > r = ``membership.read_all_up_to`` members that is neither the leader nor the next in
        line (a new plan is checked against a fresh read: ``behind``); 1 otherwise (module docstring).
        ``following``: the plan followed (None before the first)."""
        n, r = len(self._records or ()), self.config.membership.read_all_up_to
        if n <= r or self.peer_id in self._first_two:
            return 1.0
        return n / r

    def behind(self, epoch: int) -> bool:
        """Told the newest plan's epoch each time the plans are read: True the first time a plan is newer than
        any before and the peer records were last read over a poll ago (the caller reads them now)."""
        if epoch <= self._newest_epoch:
            return False
        self._newest_epoch = epoch
        return time.monotonic() - self._read_at > self.config.membership.poll_s

    def _checked_claims(self, membership: Membership) -> Membership:
        """The members whose claims a real device could make, their tflops bounded by their calibration
        (``leadership.claims``: a pure function of each record, so every agent's view agrees)."""
        shape, peak = self.config.train.shape, self.config.claims.peak_over_calibrated
        peers = {}
        for peer, record in membership.peers.items():
            problem = record_problem(record, shape)
            if problem is not None:
                self._note_claim(peer, f"ignoring peer {peer}: {problem}", "claim_refused", reason=problem)
                continue
            peers[peer] = bounded(record, shape, peak)
            if peers[peer].tflops < record.tflops:
                self._note_claim(peer, f"peer {peer} claims {record.tflops:g} TFLOP/s, {peak:g}x beyond what its "
                                 f"calibration shows: planned with {peers[peer].tflops:.3g}", "claim_bounded",
                                 claimed=record.tflops, bound=peers[peer].tflops)
        return Membership(peers)

    def _note_claim(self, peer: str, line: str, event: str, **fields: Any) -> None:
        if (peer, event) not in self._claims_noted:
            self._claims_noted.add((peer, event))
            logger.warning("%s", line)
            self.events.write(event, peer=peer, **fields)

    def _watch_targets(self, membership: Membership, plan: PlanRecord | None, partners: set[str]) -> set[str]:
        """Whom to ping: every member in a small run; beyond ``watch_all_up_to``, our pipeline neighbours, our
        replica group's fingers (``group_fingers``: O(log) of it, each member watched by as many), the leader
        and the next in line (who watch everyone), the plan's checkers (before the first plan, those of its members:
        ``PeerStatus.refused``, ``search``), and of the peers no plan of
        ours names (before the first plan: all but those two), our ``partners`` in the probe graph: a bounded
        number, so that a run of n peers does not cost n² pings a period before its first plan."""
        others = [p for p in membership.ids if p != self.peer_id]
        leader = membership.leader
        first_two = {p for p in (leader, membership.without(leader).leader) if p is not None} if leader else set()
        if len(others) <= self.config.liveness.watch_all_up_to or self.peer_id in first_two:
            return set(others)
        targets = first_two - {self.peer_id}
        if plan is not None and plan.position_of(self.peer_id) is not None:
            row, stage = plan.position_of(self.peer_id)
            targets |= {plan.peer_at(row, j) for j in (stage - 1, stage + 1) if 0 <= j < plan.stages}
            targets |= {plan.peer_at(i, stage) for i in group_fingers(row, plan.replicas)}
        if self.config.plan.checkers > 0:  # whose answers say they refused a plan, or how long their search takes
            targets |= (checkers(plan.membership, plan.leader, self.config.run, self.config.plan.checkers) if plan
                        else checkers(membership.ids, leader, self.config.run, self.config.plan.checkers) if leader
                        else set())
        return (targets & set(others)) | {p for p in others if p not in (plan.membership if plan else ()) and p in partners}


def group_fingers(row: int, replicas: int) -> set[int]:
    """The rows of a replica group of ``replicas`` that the member at ``row`` pings beyond ``watch_all_up_to``:
    those 1, 2, 4, … rows away on the group's ring, both ways, itself left out. At most 2⌈log2 R⌉ of a group of R
    (all of one of up to 5), and each member is pinged by as many, so a silent member is seen by its ring
    neighbours at once and by O(log R) members in all; the rest learn it from their halted heartbeats."""
    if not 0 <= row < replicas:
        raise ValueError(f"row {row} of a group of {replicas}")
    rows, distance = set(), 1
    while distance < replicas:
        rows |= {(row + distance) % replicas, (row - distance) % replicas}
        distance *= 2
    return rows - {row}
