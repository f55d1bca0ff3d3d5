"""What the heartbeats watch of the epoch this agent follows: who stayed away from it, and when to abort it.

    watch = EpochWatch(peer_id, config.liveness, abort=transport.abort_epoch)
    watch.begin(plan, taking_after_s, no_show_after_s)  # the main thread, as it takes an epoch up
    watch.on_round(plan, liveness)                      # the liveness thread, after every heartbeat round
    watch.abort_first(epoch, reason, failure=False)     # the step-boundary thread: a newer plan cuts a step short
    watch.end()                                         # the main thread, once the epoch is over

After every heartbeat round (``churn.liveness.LivenessMonitor``) the liveness thread aborts the epoch being
trained if one of its trainers is dead or failed it, if this agent itself was silent long enough to be
counted dead, or if a trainer stayed away from it past its time: one that does not even say it takes it
up gets the control plane's pace (``liveness.no_show_window_s``), one that says it checks the plan
(``take``) the longer allowance; one that says it trains and never sends is a stall (``StallWatch``). What
it saw is the leader's own finding (``leadership.leader.AgentView.no_shows``, ``unjudged``).

Threads and fields (every field below is read and written under ``_lock``; nothing else is shared):

| field | written by | read by |
|---|---|---|
| ``training``, ``since``, ``observing``, ``stalls``, the allowances | main (``begin``, ``end``) | liveness |
| ``on_way``, ``no_shows``, ``unjudged`` | main (``begin``), liveness (``on_round``) | liveness, the poller (``seen``) |
| ``aborted`` | liveness (``on_round``), step boundary (``abort_first``) | the poller (``aborted``) |

An epoch is aborted at most once whichever thread finds a reason first (``aborted`` is checked and set in
one hold of the lock, and the transport's abort is called outside it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from p2ptrain.agent.churn.liveness import (
    NO_SHOW_INTERVALS,
    LivenessMonitor,
    StallWatch,
    epoch_failure,
    no_shows,
    taking_up,
)
from p2ptrain.agent.config import LivenessConfig
from p2ptrain.agent.leadership.plan_check import trainers_of
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.transport.status import TRAIN, PeerStatus

logger = logging.getLogger(__name__)

Abort = Callable[..., None]  # ``Transport.abort_epoch(epoch, reason, culprit=..., failure=...)``


class EpochWatch:
    """The heartbeats' watch of the epoch followed (module docstring); ``abort`` aborts an epoch's calls."""

    def __init__(self, peer_id: str, config: LivenessConfig, abort: Abort):
        self.peer_id = peer_id
        self.config = config
        self._abort = abort
        self._lock = threading.Lock()
        self._aborted = -1  # the last epoch aborted (by the heartbeats, or cut short at a step boundary)
        self._training: int | None = None  # the epoch being trained (None between epochs)
        self._since = 0.0  # when this agent took it up
        self._no_show_after_s = math.inf  # how long a trainer of it may stay away after we took it up
        self._taking_after_s = math.inf  # how long one that says it takes it up (checks the plan) may take
        self._on_way: dict[str, float] = {}  # when we last saw each trainer train an older epoch (``_stayed_away``)
        self._observing = -1  # the epoch whose no-shows the heartbeats look for (the last one we took up)
        self._stalls: StallWatch | None = None  # its trainers that say they train it and never send
        # the trainers of the epoch taken up that this agent itself saw stay away past their time, and those away
        # from it whose time still runs
        self._no_shows: tuple[int, tuple[str, ...]] = (-1, ())
        self._unjudged: tuple[int, tuple[str, ...]] = (-1, ())

    # ---- the main thread ---------------------------------------------------------------------------------

    def begin(self, plan: PlanRecord, taking_after_s: float, no_show_after_s: float) -> None:
        """This agent takes ``plan``'s epoch up now: its no-shows are watched until it follows another."""
        with self._lock:
            self._taking_after_s, self._no_show_after_s = taking_after_s, no_show_after_s
            self._on_way = {}
            self._since = time.monotonic()
            self._observing = plan.epoch
            self._stalls = StallWatch(plan, self.peer_id, self._since, NO_SHOW_INTERVALS * self.config.interval_s)
            self._training = plan.epoch

    def end(self) -> None:
        """The epoch is over (finished, halted or stopped): nothing is trained to abort."""
        with self._lock:
            self._training = None

    # ---- the poller (the main thread, or the step-boundary thread while an epoch trains) -------------------

    @property
    def training(self) -> int | None:
        with self._lock:
            return self._training

    @property
    def aborted(self) -> int:
        """The last epoch aborted, -1 if none."""
        with self._lock:
            return self._aborted

    def seen(self, epoch: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """For ``epoch``: the trainers seen stay away past their time, and those away whose time still runs."""
        with self._lock:
            no_shows_, unjudged = self._no_shows, self._unjudged
        return (no_shows_[1] if no_shows_[0] == epoch else ()), (unjudged[1] if unjudged[0] == epoch else ())

    def abort_first(self, epoch: int, reason: str, *, culprit: str | None = None, failure: bool = True) -> bool:
        """Abort ``epoch``'s calls unless it was aborted already; whether this call did."""
        with self._lock:
            if epoch <= self._aborted:
                return False
            self._aborted = epoch
        self._abort(epoch, reason, culprit=culprit, failure=failure)
        return True

    # ---- the liveness thread -----------------------------------------------------------------------------

    def on_round(self, plan: PlanRecord | None, liveness: LivenessMonitor) -> None:
        """After a heartbeat round, ``plan`` the one followed: abort its epoch if one of its trainers is dead,
        failed it or stayed away past its time, or if this agent was silent long enough to be counted dead."""
        silent_s = liveness.take_silence()
        if plan is None:
            return
        answered, statuses = liveness.answered(), liveness.statuses()
        with self._lock:
            if plan.epoch != self._observing:
                return
            # who stayed away from the epoch we took up, also once it halted (on someone else's finding): the
            # leader re-plans on what its own heartbeats saw
            absent = self._stayed_away(plan, statuses, answered)
            stalls, stalled = self._stalls, []
            if stalls is not None and stalls.epoch == plan.epoch:  # and who trains it in name only
                stalled = stalls.observe(statuses, answered)
                running = set(stalls.unjudged()) - set(stalled) | set(self._unjudged[1])
                self._unjudged = (plan.epoch, tuple(sorted(running)))
            absent = sorted(set(absent) | set(stalled))
            if absent and silent_s <= self.config.timeout_s:
                seen = set(self._no_shows[1]) if self._no_shows[0] == plan.epoch else set()
                self._no_shows = (plan.epoch, tuple(sorted(seen | set(absent))))
            if plan.epoch <= self._aborted or plan.epoch != self._training:
                return
            since = self._since
        dead, timeout_s = liveness.dead(), self.config.timeout_s
        reason = epoch_failure(plan, self.peer_id, dead, statuses)
        if reason is None and silent_s > timeout_s:
            reason = f"this agent was silent for {silent_s:.0f} s (stopped or cut off): its peers re-planned without it"
        if reason is None and absent:
            reason = (f"peer(s) {', '.join(absent)} answer heartbeats but have not taken up epoch {plan.epoch} "
                      f"{time.monotonic() - since:.1f} s after this agent did")
            if stalled:
                reason += (f" (say they train it, but wait on nobody and sent nothing: {', '.join(stalled)}; the "
                           f"others' first messages allow {stalls.pace_s():.1f} s)")
        else:
            absent = []
        if reason is None:
            return
        # a trainer found dead, or that never took up the epoch, is where the blames of the cascade end (not after
        # our own silence)
        gone = sorted(set(dead) & set(trainers_of(plan)) - {self.peer_id}) or absent
        culprit = gone[0] if gone and silent_s <= timeout_s else None
        if self.abort_first(plan.epoch, reason, culprit=culprit):
            logger.warning("epoch %d: %s; halting it", plan.epoch, reason)

    def _stayed_away(self, plan: PlanRecord, statuses: dict[str, PeerStatus], answered: dict[str, float]) -> list[str]:
        """The trainers of ``plan`` whose answer to our heartbeat says they neither train its epoch nor are on
        their way to it, past their time (module docstring). Counted from when we took the epoch up until the
        answer came (``answered``: a stale answer, our own pings starved, proves nothing), or, for a trainer we
        last saw train an older epoch toward this one's start (a join re-plan point), from then: it still has
        to publish its halt and read the plan. Under the lock."""
        for peer, status in statuses.items():
            if status.state == TRAIN and status.epoch < plan.epoch:
                self._on_way[peer] = answered.get(peer, time.monotonic())

        def away_s(peer: str) -> float:
            return answered.get(peer, -math.inf) - max(self._since, self._on_way.get(peer, -math.inf))

        away = {p: self._no_show_after_s for p in no_shows(plan, self.peer_id, statuses)}  # busy ones: longer
        away.update({p: self._taking_after_s for p in taking_up(plan, self.peer_id, statuses)})
        self._unjudged = (plan.epoch, tuple(sorted(p for p, allowed_s in away.items() if away_s(p) <= allowed_s)))
        return sorted(p for p, allowed_s in away.items() if away_s(p) > allowed_s)
