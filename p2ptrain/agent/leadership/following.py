"""What the run says to the poller (``agent.Agent``'s plan tracking): the plan to follow next, what the plan
and progress records read last say, and when to pass a leader over or step aside.

``Following`` is a part of the agent, written by the *poller* (the main thread while no epoch trains, the
step-boundary thread while one does; ``agent``'s docstring) except where said: ``followed`` and
``halted_epoch`` by the main thread as an epoch starts and ends, ``run_moved_at`` by both (one float: the
later write wins, either way the idle clock restarts). It reads the agent's live view (``Agent._membership``,
the poller's), the plan it follows (``Agent._following``, the main thread's) and its parts (the plan gate, the
leader's side, the heartbeats).

- ``next_plan``: read the plan records (``_plans_due``: every poll by the leader; by a follower when a peer it
  pings knows of a plan newer than any of its leader's it read, ``PeerStatus.plan``, else every ``PLANS_READ_S``: n followers of
  an idle run no longer read n plan records a second); the highest epoch signed by the leader in
  our view that names us and that the plan gate accepts (``election.latest_plan``, ``plan_check.PlanGate``); meanwhile what the run's
  progress says of who may lead (``standing``), read on a thread of its own every ``STANDING_READ_S`` once the run
  has a plan.
- ``pass_over``: leave a leader out of our view (``Leader.pass_over``); ``_step_aside``: our own plan is
  trained by nobody while the run trains another's: we were passed over; ``_follow_the_run``: the run
  passed our leader over; ``_check_culpable_leader``: the epoch we follow failed at its leader's own stage.
- ``finished_without_me``: the run finished on a plan that left us out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from p2ptrain.agent.leadership.election import finished_without, latest_plan
from p2ptrain.agent.leadership.plan_check import CulpableWatch, trainers_of
from p2ptrain.agent.leadership.standing import followed_instead
from p2ptrain.errors import AgentError, ProtocolError
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.transport.status import FAIL, TAKE, PeerStatus

if TYPE_CHECKING:
    from p2ptrain.agent.agent import Agent

logger = logging.getLogger(__name__)

HEARD_READS = 3  # reads for a plan epoch the heartbeats told of that none read had (``_plans_due``)
PLANS_READ_S = 5.0  # a follower whose leader announces no newer plan reads the plan records this often (× spacing)
STANDING_READ_S = 2.0  # how often the progress records are read for who may lead (``leadership.standing``)
FOLLOWED_KEPT = 4  # followed plans read against the progress records (a peer's record holds its newest epoch)


class Following:
    def __init__(self, agent: Agent):
        self.agent = agent
        self.config, self.peer_id, self.dht, self.transport, self.events = (
            agent.config, agent.peer_id, agent.dht, agent.transport, agent.events)
        membership = self.config.membership
        self._culpable = CulpableWatch(membership.poll_s, run=self.config.run, false_alarm=self.config.verify.false_alarm)
        self.newest_seen: PlanRecord | None = None  # the highest-epoch plan read from a live signer
        self.newest_any: PlanRecord | None = None  # ... from any signer (a finished run's leader leaves)
        self.plans_read: tuple[PlanRecord, ...] = ()  # the plan records of the last read, one per signer
        self.max_epoch_seen = -1  # over every verified plan: a new leader numbers above it
        self._plans_logged: Any = None
        self.halted_epoch = -1  # the last epoch this agent halted on a failure
        # the progress records read for the standing (``_observe_standing``): the read in flight, when it began
        self._standing_reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-standing")
        self._standing_read: concurrent.futures.Future | None = None
        self._standing_last = -float("inf")
        self.followed: list[PlanRecord] = []  # the last plans this agent followed
        # the furthest (epoch, step) any progress record said, and when it last moved or our last epoch ended:
        # an agent that does not train waits at most ``idle_timeout_s`` on a run that does not move
        self._run_furthest: tuple[int, int] = (-1, -1)
        self.progress_seen: dict[str, ProgressRecord] = {}  # the last progress records read (``_observe_standing``)
        self._before_taking: PeerStatus | None = None  # what we said before ``take``, while a plan's checkers' word is due
        self.run_moved_at = time.monotonic()
        # the plan records read last, when, and who led in our view then (``_plans_due``); the plans we publish
        # as leader are announced in our heartbeat answers from the moment they are stored
        self._plans: dict[str, PlanRecord] = {}
        self._plans_read_at, self._plans_leader = -float("inf"), None
        self._heard = (-1, 0)  # the newest plan epoch the heartbeats told of, and the reads made for it
        agent.dht.plan_listeners.append(self._announce_plan)

    def close(self) -> None:
        self._standing_reader.shutdown(wait=False, cancel_futures=True)

    def follow(self, plan: PlanRecord) -> None:
        """The main thread starts following ``plan``: its progress earns standing (``leadership.standing``)."""
        self.followed.append(plan)
        del self.followed[:-FOLLOWED_KEPT]

    def next_plan(self) -> PlanRecord | None:
        """The plan to follow next (``election.latest_plan``), or None."""
        self._check_culpable_leader()
        started = time.monotonic()
        if self._plans_due(started):
            try:
                plans = self.dht.read_plans()
            except ProtocolError as e:
                logger.warning("reading the plan records failed: %s", e)
                return None
            self.agent._leaders.observe_read(time.monotonic() - started)  # the control plane's pace: a leader's grace
            self._plans_read_at, self._plans_leader, self._plans = started, self.agent._membership.leader, plans
        else:
            plans = self._plans  # nothing new said: the last records read stand
        if self.agent._reader.behind(max((p.epoch for p in plans.values()), default=-1)):
            self.agent._poll(force=True)  # a newer plan: checked against the peer records as they are now
        refusal = self.agent._tracker.refusal()  # several live peers agree on other data or settings than ours
        if refusal is not None:
            raise AgentError(refusal)
        live = self.agent._membership.ids
        self.max_epoch_seen = max([self.max_epoch_seen, *(p.epoch for p in plans.values())])
        self._announce_plan(self.max_epoch_seen)
        key = (frozenset(plans.items()), live)
        log, self._plans_logged = key != self._plans_logged, key  # say what is ignored once per change
        after = self.agent._following.epoch if self.agent._following is not None else -1
        self.plans_read = tuple(plans.values())
        self._observe_standing(plans)
        plan = latest_plan(plans, live, self.peer_id, after, log=log, leader=self.agent._membership.leader) if live else None
        # the run's first epoch for us: nothing followed, no earlier plan seen (a joiner's first plan may
        # leave out live peers: the quarantined, or joiners after it)
        newest = self.newest_seen
        first = self.agent._following is None and (newest is None or self.agent._gate.refused(newest) or
                                             (plan is not None and newest.epoch >= plan.epoch))
        if plan is not None:
            with self._taking_up(plan):
                if not self.agent._gate.accept(plan, self.agent._membership.peers, self.agent._tracker.known_for_s, first=first):
                    plan = None
        theirs = plans.get(self.agent._membership.leader) if live else None
        if (plan is None and theirs is not None and self.agent._following is None and self.peer_id not in theirs.membership
                and self.agent._gate.left_out(theirs, live, self.agent._tracker.known_for_s, self._untrained,
                                               self.agent._reader.watched)):
            return None  # the run's first plan left us out, and others an honest leader would have planned
        # a plan by a peer that is not live (a rogue, a leader long dead), or one we refused, is never the
        # one being trained
        if self.newest_seen is not None and self.agent._gate.refused(self.newest_seen):
            self.newest_seen = None
        newest = max((p for s, p in plans.items() if s in live and not self.agent._gate.refused(p)), key=lambda p: p.epoch,
                     default=None)
        if newest is not None and (self.newest_seen is None or newest.epoch > self.newest_seen.epoch):
            self.newest_seen = newest
        self.newest_any = max((p for p in plans.values() if not self.agent._gate.refused(p)), key=lambda p: p.epoch,
                               default=None)
        return plan

    def _announce_plan(self, epoch: int) -> None:
        """Our ping answers say from now on that a plan of ``epoch`` exists (``PeerStatus.plan``): we published
        it, or read it."""
        announced = self.transport.announced
        announced.plan = max(announced.plan, epoch)

    def _plans_due(self, now: float) -> bool:
        """Whether the plan records are read this poll (module docstring): by the leader and by agents without
        heartbeats always; by the others after their leader changed, while its answers are late, at least every
        ``PLANS_READ_S`` times the reader's spacing, and when a peer we ping knows of a plan newer than any of our leader's we read
        (``PeerStatus.plan``: its leader published it, or it read it; ``HEARD_READS`` reads for each such epoch,
        which a record that expired since would otherwise cost every poll): newer than our leader's newest plan
        read, whatever other signers' plans we read."""
        agent = self.agent
        leader, liveness = agent._membership.leader, agent.liveness
        if liveness is None or leader is None or leader == self.peer_id or leader != self._plans_leader:
            return True
        period = min(PLANS_READ_S * agent._reader.spacing(agent._following), self.config.dht.peer_ttl_s)
        statuses, answered = liveness.statuses(), liveness.answered().get(leader)
        late_s = 2 * self.config.liveness.interval_s + self.config.liveness.ping_timeout_s
        if now - self._plans_read_at >= period or leader not in statuses or answered is None or now - answered > late_s:
            return True
        heard = max(s.plan for s in statuses.values())
        # against our leader's newest plan read, not any signer's: a passed-over leader's plan of the same epoch,
        # read first, must not hide the new leader's (its trainers would find us not taking it up)
        if heard <= (self._plans[leader].epoch if leader in self._plans else -1):
            return False
        epoch, reads = self._heard if self._heard[0] == heard else (heard, 0)
        self._heard = (epoch, reads + 1)
        return reads < HEARD_READS

    @contextlib.contextmanager
    def _taking_up(self, plan: PlanRecord):
        """While we check ``plan`` (a search of its records: seconds on a slow CPU), or wait for its checkers' word
        (``PlanGate.awaits_word``), heartbeats say we take its epoch up (``take``), so its trainers give us that
        time (``liveness.taking_up``); after, what they said before: ``_follow`` then says ``train``."""
        before = self._before_taking or self.transport.status
        if self.peer_id in trainers_of(plan) and before.epoch <= plan.epoch:
            self.transport.status = PeerStatus(TAKE, plan.epoch, plan.start_step)
        try:
            yield
        finally:
            waiting = self.agent._gate.awaits_word(plan)
            self._before_taking = before if waiting else None
            if not waiting:
                self.transport.status = before

    def _observe_standing(self, plans: dict[str, PlanRecord]) -> None:
        """Who has shown training work (``leadership.standing``): the plans read, and the ones we followed,
        against the progress records, read every ``STANDING_READ_S`` on a thread of their own (a DHT read can
        hang for its whole deadline while a peer is frozen; the loop must not wait on it)."""
        pending = self._standing_read
        if pending is not None and pending.done():
            self._standing_read = None
            try:
                progress = pending.result()
            except Exception as e:  # noqa: BLE001 - a failed read is retried, never a verdict
                logger.debug("reading the progress records for the standing failed: %s", e)
            else:
                self.agent._leaders.standing.observe((*plans.values(), self.newest_seen), progress, followed=self.followed)
                self._note_run_progress(progress)
                self.progress_seen = progress
                self._step_aside(plans, progress)
                self._follow_the_run(plans, progress)
        now = time.monotonic()  # no plan in the run: no progress to read (an idle run's start costs less)
        if plans and self._standing_read is None and now - self._standing_last >= self.progress_period_s():
            self._standing_last = now
            self._standing_read = self._standing_reader.submit(self.dht.read_progress)

    def progress_period_s(self) -> float:
        """How often the progress records are read (``_observe_standing``): a follower in a large run, less often."""
        spacing = self.agent._reader.spacing(self.agent._following)
        return min(STANDING_READ_S * spacing, self.config.dht.peer_ttl_s)

    def _note_run_progress(self, progress: dict[str, ProgressRecord]) -> None:
        """Move the idle clock (``membership.idle_timeout_s``) when any record says the run got further."""
        furthest = max(((r.epoch, r.step) for r in progress.values()), default=(-1, -1))
        if furthest > self._run_furthest:
            self._run_furthest, self.run_moved_at = furthest, time.monotonic()

    def _step_aside(self, plans: dict[str, PlanRecord], progress: dict[str, ProgressRecord]) -> None:
        """While we lead in our own view: if the run's own trainers train another live peer's plan and nobody
        trains ours (``standing.followed_instead``), the run passed us over (its followers judged us culpable or
        silent, rightly or not). We step aside as a passed-over leader does (out of standing for the epochs owed, a
        back-off): the peer the run follows leads in our view too, and we join its run at a re-plan point, or
        see it finish without us (``_finished_without_me``), instead of waiting alone on a plan nobody trains."""
        following = self.agent._following
        if self.agent._membership.leader != self.peer_id or (following is not None and following.leader != self.peer_id):
            return  # not leading, or training another's plan with the run (a joiner that earned standing)
        plan = followed_instead(self.peer_id, (self.agent._following, self.agent._leading.published), plans,
                                self.agent._membership.ids, progress, self.agent._leaders.standing)
        if plan is not None:
            backoff = self.agent._leaders.pass_over(self.peer_id)
            logger.warning("the run's trainers train epoch %d of %s's plan, not ours: this agent was passed over as "
                           "leader; it steps aside for %.0f s and follows the run's leader", plan.epoch, plan.leader,
                           backoff)
            self.events.write("stepped_aside", epoch=plan.epoch, leader=plan.leader, backoff_s=backoff)

    def _follow_the_run(self, plans: dict[str, PlanRecord], progress: dict[str, ProgressRecord]) -> None:
        """While another peer leads in our view: if the run's own trainers train a third live peer's plan while
        nobody trains our leader's (``standing.followed_instead``), the run passed our leader over (a spare, or an
        agent that was waiting, did not see it fall silent or fail): we pass it over too and follow the run."""
        leader, following = self.agent._membership.leader, self.agent._following
        if leader is None or leader == self.peer_id or (following is not None and following.leader != leader):
            return  # we train another's plan with the run (our leader's turn is the next re-plan)
        plan = followed_instead(leader, (plans.get(leader), following), plans, self.agent._membership.ids, progress,
                                self.agent._leaders.standing)
        if plan is not None and plan.leader != self.peer_id:
            self.pass_over(leader, f"the run's trainers train epoch {plan.epoch} of {plan.leader}'s plan, and "
                                    "nobody trains its own")

    def _check_culpable_leader(self) -> None:
        """Once the epoch we follow failed (we halted it, or a heartbeat says a trainer did), pass its leader
        over at once if the failure was its own stage's (``plan_check.culpable_leader``)."""
        plan, leader, newest = self.agent._following, self.agent._membership.leader, self.newest_seen
        if plan is None or leader is None or plan.leader != leader or leader == self.peer_id:
            return
        if newest is not None and newest.epoch > plan.epoch and newest.leader == leader:
            return  # it planned the next epoch already: it does its job
        statuses = self.agent.liveness.statuses() if self.agent.liveness is not None else {}
        failed = self.halted_epoch == plan.epoch or self.agent._epochs.aborted == plan.epoch or any(
            s.state == FAIL and s.epoch == plan.epoch for s in statuses.values())
        if not failed:
            return
        try:
            why = self._culpable.check(plan, self.dht.read_progress)
        except ProtocolError:
            return
        if why is not None:
            self.pass_over(leader, why)

    def pass_over(self, leader: str, why: str) -> None:
        """Pass ``leader`` over (``Leader.pass_over``) and leave it out of the view this poll goes on with: the
        next in line may lead in the same poll, and must not plan it."""
        self.agent._leading.pass_over(leader, why)
        self.agent._membership = self.agent._membership.without(leader)

    def _untrained(self) -> bool:
        """Whether no peer says it trained a step of this run yet (its progress records)."""
        try:
            return all(r.step == 0 for r in self.dht.read_progress().values())
        except ProtocolError:
            return False

    def finished_without_me(self) -> PlanRecord | None:
        """The newest plan, if it left us out (we came back after being cut off) and its trainers finished
        the run (``election.finished_without``), from a live signer or not."""
        followed = self.agent._following.epoch if self.agent._following is not None else -1
        try:
            return finished_without((self.newest_seen, self.newest_any, *self.plans_read), self.peer_id, followed,
                                    self.dht.read_progress, self.config.train.steps,
                                    self.agent._following.leader if self.agent._following is not None else None)
        except ProtocolError:
            return None
