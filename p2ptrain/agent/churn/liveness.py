"""Liveness separate from data: heartbeat pings that notice a killed or cut-off peer within seconds.

Tensor calls can be slow for good reasons (half a gigabyte over 0.1 Gbit/s takes 40 s), so a short data
deadline would call slow links dead, and a long one makes every failure cost that long. Instead an agent
pings the peers it watches every ``interval_s`` (``transport.status``: a tiny message answered at once by the
transport's event loop, whatever training is doing) and keeps, per peer, when it last answered:

* ``PeerHealth`` (pure, clock passed in): a watched peer is *dead* once it has not answered for
  ``timeout_s``, or at once after three pings in a row that could not even reach it (its daemon is gone:
  the connection is refused) — never before two pings were tried;
* ``LivenessMonitor``: the thread that pings (all at once, on the transport's loop) and calls back after
  every round. A silence of its own (no round for ``timeout_s``: the process was stopped or starved) or a
  round in which no peer answered in time (more likely our own loop or link than every peer at once) judges
  every peer afresh, and ``take_silence`` tells the agent: its peers have counted it dead and re-planned,
  so the epoch it was training is over;
* ``epoch_failure`` (pure): whether the epoch this agent trains must halt now: a trainer of the plan is
  dead, or answers that it stopped the epoch on a failure (state ``fail``). A trainer that stopped at a
  re-plan point (``halt``) or trains a newer epoch is no failure: every trainer stops there at the same step;
* ``no_shows`` (pure): the trainers of the plan that answer pings but have not taken up its epoch, nor say
  they are taking it up (``take``: checking the plan); ``taking_up``: those that say so. A peer that ignores
  its stage, or never read the plan, is as good as dead for the epoch (waiting out the tensor deadline on it
  cost a minute), so the agent halts the epoch once one of them is still not there, at the control plane's
  pace (``no_show_window_s``): an idle honest trainer reads a published plan within what a leader's grace
  allows (our own DHT reads, ``LeaderWatch.grace_s``) and a poll, and says ``take`` from then on; one that
  says so, or that still ends an older epoch it halted (its halted record to publish first), gets
  ``NO_SHOW_TIMEOUTS`` × ``timeout_s`` and twice our own check of the plan (a slow CPU checks slowly).
* ``StallWatch`` (pure, times passed in): the trainers that say they train the epoch but never take their stage
  up: their answers say they wait on nobody (``PeerStatus.waits``) and sent no training message of it
  (``sent``), for ``STALL_PACE`` times as long as the slowest first message of the trainers that sent one took
  after we took the epoch up (the run's own pace: state loads, warm-up, the first forward), at least
  ``NO_SHOW_INTERVALS`` heartbeat intervals. An honest trainer with its input computes one micro-batch before
  its first message goes out; one that waits on a neighbour says so. Nobody sent yet: no verdict (the tensor
  deadline decides).

The agent halts the epoch through ``Transport.abort_epoch`` (pending calls fail at once with PeerFailed),
and leaves dead peers out of its view of the live members until they answer again, so the next leader
takes over and re-plans without waiting for the dead peer's records to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from p2ptrain.agent.config import LivenessConfig
from p2ptrain.errors import PeerTimeoutError, ProtocolError
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.status import FAIL, HALT, IDLE, TAKE, TRAIN, PeerStatus

logger = logging.getLogger(__name__)

UNREACHABLE_IN_A_ROW = 3
NO_SHOW_TIMEOUTS = 2.0  # liveness timeouts a trainer that says it takes up an epoch may take after we took it up
NO_SHOW_INTERVALS = 3.0  # the least heartbeat intervals a trainer may take to read a plan after we took it up
STALL_PACE = 4.0  # a trainer that sent nothing may idle this many times the slowest first message (``StallWatch``)


@dataclass
class _Peer:
    since: float  # watched since
    last_ok: float | None = None
    tries: int = 0
    unreachable: int = 0  # pings in a row that could not reach the peer at all
    status: PeerStatus | None = None


class PeerHealth:
    """Per watched peer: the last answer and its time; which peers are dead. No I/O."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}

    def watch(self, peers: Iterable[str]) -> None:
        """Watch exactly ``peers`` from now on (a peer watched again starts afresh)."""
        peers = set(peers)
        now = self.clock()
        self._peers = {p: self._peers.get(p) or _Peer(since=now) for p in peers}

    @property
    def watched(self) -> list[str]:
        return sorted(self._peers)

    def record(self, peer: str, result: PeerStatus | ProtocolError) -> None:
        state = self._peers.get(peer)
        if state is None:
            return
        state.tries += 1
        if isinstance(result, PeerStatus):
            state.last_ok, state.status, state.unreachable = self.clock(), result, 0
        elif isinstance(result, PeerTimeoutError):
            pass  # alive but stopped, or a dial that hangs: the timeout decides
        else:
            state.unreachable += 1

    def is_dead(self, peer: str) -> bool:
        state = self._peers.get(peer)
        if state is None or state.tries < 2:
            return False
        if state.unreachable >= UNREACHABLE_IN_A_ROW:
            return True
        return self.clock() - (state.last_ok if state.last_ok is not None else state.since) >= self.timeout_s

    def dead(self) -> frozenset[str]:
        return frozenset(p for p in self._peers if self.is_dead(p))

    def forgive(self) -> None:
        """Start every peer afresh: the silence was ours (this process was stopped or starved), not theirs."""
        now = self.clock()
        self._peers = {p: _Peer(since=now) for p in self._peers}

    def statuses(self) -> dict[str, PeerStatus]:
        """The last answer of every watched peer that is not dead."""
        return {p: s.status for p, s in self._peers.items() if s.status is not None and not self.is_dead(p)}

    def answered(self) -> dict[str, float]:
        """When (our clock) each watched peer that is not dead gave its last answer (``statuses``)."""
        return {p: s.last_ok for p, s in self._peers.items() if s.last_ok is not None and not self.is_dead(p)}


def epoch_failure(plan: PlanRecord, me: str, dead: Iterable[str], statuses: Mapping[str, PeerStatus]) -> str | None:
    """Why the epoch of ``plan`` must halt now for trainer ``me`` (None: go on)."""
    trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)}
    if me not in trainers:
        return None
    gone = sorted(set(dead) & trainers - {me})
    if gone:
        return f"peer(s) {', '.join(gone)} stopped answering heartbeats"
    failed = sorted(p for p, s in statuses.items() if p in trainers and s.state == FAIL and s.epoch == plan.epoch)
    if failed:
        return f"peer(s) {', '.join(failed)} stopped epoch {plan.epoch} on a failure"
    return None


def no_shows(plan: PlanRecord, me: str, statuses: Mapping[str, PeerStatus]) -> list[str]:
    """The trainers of ``plan`` whose last answer says they have not taken up its epoch and are not on their
    way to it: idle, halted or failed in an older epoch, or idle in this one at its start (a spare of
    another plan). A trainer still training an older epoch toward this one's start is on its way (a join
    re-plan point), and so is one that says it takes this epoch up (``taking_up``); one we have no answer
    from is the heartbeats' to judge (dead or not)."""
    trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)} - {me}
    late = []
    for peer in sorted(trainers):
        s = statuses.get(peer)
        if s is None or s.epoch > plan.epoch or (s.epoch < plan.epoch and s.state == TRAIN):
            continue
        if s.epoch < plan.epoch or (s.state == IDLE and s.step <= plan.start_step):
            late.append(peer)
    return late


def taking_up(plan: PlanRecord, me: str, statuses: Mapping[str, PeerStatus]) -> list[str]:
    """The trainers of ``plan`` (but ``me``) whose last answer says they are on their way to its epoch but busy:
    taking it up (``take``: checking the plan), or still ending an older epoch they halted (``halt``, ``fail``:
    a halted record to publish, a DHT store that can take seconds, before they read plans again)."""
    trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)} - {me}
    return sorted(p for p in trainers if (s := statuses.get(p)) is not None and (
        (s.state == TAKE and s.epoch == plan.epoch) or (s.state in (HALT, FAIL) and s.epoch < plan.epoch)))


def no_show_window_s(interval_s: float, grace_s: float, poll_s: float, taking_s: float) -> float:
    """How long after we took an epoch up a trainer that says it idles may stay away: what a leader's grace
    allows for a published record to be read (``grace_s``, the control plane's pace), one poll of the reader's
    and one heartbeat interval (its answer's age); at least ``NO_SHOW_INTERVALS`` intervals, at most what a
    trainer busy on its way gets (``taking_s``)."""
    return min(taking_s, max(NO_SHOW_INTERVALS * interval_s, grace_s + poll_s + interval_s))


class StallWatch:
    """The trainers of ``plan`` (but ``me``) that say they train its epoch and never take their stage up (see the
    module's notes); ``since``: when we took the epoch up; times are our clock's, of the answers (``answered``)."""

    def __init__(self, plan: PlanRecord, me: str, since: float, floor_s: float):
        self.epoch, self.since, self.floor_s = plan.epoch, since, floor_s
        self.trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)} - {me}
        self._first_sent: dict[str, float] = {}  # when each trainer was first seen to have sent a message
        self._idle_since: dict[str, float] = {}  # since when each has been seen to train, wait on nobody, send nothing

    def pace_s(self) -> float | None:
        """How long a trainer may wait on nobody with nothing sent (None: nobody sent anything yet)."""
        if not self._first_sent:
            return None
        return max(self.floor_s, STALL_PACE * max(t - self.since for t in self._first_sent.values()))

    def observe(self, statuses: Mapping[str, PeerStatus], answered: Mapping[str, float]) -> list[str]:
        """The stalled trainers after this round's answers."""
        for peer in self.trainers:
            s, at = statuses.get(peer), answered.get(peer)
            if s is None or at is None or s.epoch != self.epoch:
                self._idle_since.pop(peer, None)
            elif s.sent > 0:
                self._first_sent.setdefault(peer, at)
                self._idle_since.pop(peer, None)
            elif s.state == TRAIN and not s.waits:
                self._idle_since.setdefault(peer, at)
            else:
                self._idle_since.pop(peer, None)
        pace_s = self.pace_s()
        if pace_s is None:
            return []
        return sorted(p for p, t in self._idle_since.items() if answered[p] - max(t, self.since) > pace_s)

    def unjudged(self) -> list[str]:
        """The trainers seen waiting on nobody with nothing sent whose time still runs (none before anyone sent:
        then no verdict comes)."""
        return sorted(self._idle_since) if self.pace_s() is not None else []


class LivenessMonitor:
    """Pings the watched peers every ``interval_s`` on a daemon thread; ``on_round`` runs after each round
    (on that thread: keep it short)."""

    def __init__(self, transport: Transport, config: LivenessConfig, on_round: Callable[[], None] | None = None):
        self.transport, self.config, self.on_round = transport, config, on_round
        self.health = PeerHealth(config.timeout_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2ptrain-liveness", daemon=True)
        self._dead_logged: frozenset[str] = frozenset()
        self._silent_s = 0.0  # the longest gap of ours not yet taken by ``take_silence``

    def start(self) -> LivenessMonitor:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def watch(self, peers: Iterable[str]) -> None:
        peers = set(peers)
        with self._lock:
            if peers != set(self.health.watched):
                self.health.watch(peers)

    def dead(self) -> frozenset[str]:
        with self._lock:
            return self.health.dead()

    def take_silence(self) -> float:
        """How long this agent itself was silent (stopped, cut off, starved) since the last call, when that
        was long enough for its peers to count it dead (0 otherwise)."""
        with self._lock:
            silent, self._silent_s = self._silent_s, 0.0
        return silent

    def statuses(self) -> dict[str, PeerStatus]:
        with self._lock:
            return self.health.statuses()

    def answered(self) -> dict[str, float]:
        with self._lock:
            return self.health.answered()

    def _run(self) -> None:
        last_round = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            with self._lock:
                if started - last_round > self.config.timeout_s:
                    logger.warning("no heartbeat round for %.1f s (this process was stopped or starved): "
                                   "judging peers afresh", started - last_round)
                    self.health.forgive()
                    self._silent_s = max(self._silent_s, started - last_round)
                peers = self.health.watched
            last_round = started
            if peers:
                try:
                    results = self.transport.ping_all(peers, self.config.ping_timeout_s)
                except (TimeoutError, RuntimeError) as e:  # the transport is shutting down, or its loop is stuck
                    if self._stop.is_set():
                        return
                    logger.warning("heartbeat round failed: %s", e)
                    results = {}
                with self._lock:
                    if len(results) >= 2 and all(isinstance(r, PeerTimeoutError) for r in results.values()):
                        # nobody answered in time: more likely our own loop or link than every peer at once
                        logger.warning("no peer answered a heartbeat round in time; judging peers afresh")
                        self.health.forgive()
                        self._silent_s = max(self._silent_s, time.monotonic() - started)
                    else:
                        for peer, result in results.items():
                            self.health.record(peer, result)
                    dead = self.health.dead()
                if dead != self._dead_logged:
                    for peer in sorted(dead - self._dead_logged):
                        logger.warning("peer %s stopped answering heartbeats (%s)", peer, results.get(peer))
                    for peer in sorted(self._dead_logged - dead):
                        logger.info("peer %s is no longer judged dead (it answered, or it is no longer watched)", peer)
                    self._dead_logged = dead
                if self.on_round is not None:
                    try:
                        self.on_round()
                    except Exception:  # a bug in the callback must not stop heartbeats
                        logger.exception("liveness callback failed")
            self._stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))
