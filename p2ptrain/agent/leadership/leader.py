"""The leader's side of an agent: when a plan is due, the planner run off the loop, the plan published.

    leading = Leader(config, dht, events, peer_id, leaders, view=agent_view, note_waiting=note,
                      boundary_s=boundary_costs_s, started=time.monotonic())
    leading.lead(membership)                      # while we are the lowest live peer, every poll
    membership = leading.watch_leader(membership)  # while another peer leads
    leading.close()

The agent (``agent.Agent``) owns one. It calls ``lead`` on every poll while it leads: from its loop, or
while an epoch trains from the step-boundary thread (``churn.boundary``). Each call moves the leader on:

1. **first plan**: once ``plan_trigger`` fires (expected peers present, or the join deadline passed) and
   every trainer's links row covers the others (or ``links_timeout_s`` passed); with ``checkpoint.resume``
   it starts from the newest step every stage has a copy of (``_first_start``). With ``stages = "auto"``
   it first chooses the run's stage count (``run_stages.choose_run_stages``, in the planner thread), or
   takes the one of the checkpoint it resumes from; every later plan keeps it (``run_stages.RunStages``).
2. **re-plan**: once a plan is followed, ``replan.ReplanWatch`` says when the next is due (the live
   trainers halted after a failure, joiners at a re-plan point). Whom a failure is on is the judge's
   (``judgement.Judge``): evidence re-checked, culprits quarantined, the peers blamed counted; the compute
   each trainer showed replaces its claim (``leadership.claims``).
3. **planning**: the planner runs in a thread of its own (``_Planning``), so polling and heartbeats go on.
4. **publishing**: the plan gets its start step and sources, who keeps each stage's warm copy
   (``leader.warm_copies``) and the run's settings, and is published as the epoch above every one seen;
   nothing more is planned until the swarm takes it up.

A peer that does not lead watches the leader (``watch_leader``, ``watching.Watching``): one that publishes no
plan we accept in time is passed over (``plan_check.LeaderWatch``), and the next-lowest peer leads. The
workload a plan is priced with (``plan_workload``, ``pricing.PlanPricing``) is the same for the leader and for
the followers that check its plans. Whom a failure is on, and who is quarantined, is ``judgement.Judge``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import statistics
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2ptrain.agent.churn.replan import FAILURE, JOIN, Replan, ReplanWatch
from p2ptrain.agent.churn.restart import (
    CHECKPOINT,
    INIT,
    copies_of,
    join_start,
    restart_point,
    source_indices,
)
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership import probe_set, settings
from p2ptrain.agent.leadership.claims import with_slowdowns
from p2ptrain.agent.leadership.disputes import Fetch
from p2ptrain.agent.leadership.judgement import Judge
from p2ptrain.agent.leadership.membership import Membership, plan_trigger
from p2ptrain.agent.leadership.plan_check import LeaderWatch
from p2ptrain.agent.leadership.plan_maker import (
    build_cluster,
    cluster_order,
    compute_estimate_s,
    kept_apart,
    link_gaps,
    links_enough,
    make_plan,
    stage_state_bytes,
    trainers_and_spares,
    unmeasured_links,
    warm_copies,
    with_company,
)
from p2ptrain.agent.leadership.pricing import PlanPricing
from p2ptrain.agent.leadership.run_stages import RunStages, at_stages, choose_run_stages, stages_on_disk
from p2ptrain.agent.leadership.watching import LinksWait, Watching
from p2ptrain.errors import AgentError, ProtocolError
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.records import NO_BACKUP, PlanRecord, ProgressRecord
from p2ptrain.net.transport.status import Announced, PeerStatus
from p2ptrain.planning import Cluster, LayeredWorkload, Workload
from p2ptrain.planning.simulated import StepWorkload
from p2ptrain.planning.split import Layers
from p2ptrain.runtime.checkpoint import latest_complete
from p2ptrain.runtime.config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentView:
    """What the leader's side reads of the agent that owns it, taken afresh each time it is read."""

    seen: Membership  # the live view before passed-over leaders are left out
    following: PlanRecord | None  # the last plan the agent followed
    newest_seen: PlanRecord | None  # the highest-epoch plan read from a live signer
    done_now: int | None  # steps done in the epoch being trained
    max_epoch_seen: int  # over every verified plan: a new leader numbers above it
    # each watched peer's last answer to our heartbeat pings (``LivenessMonitor.statuses``; none without them)
    statuses: Mapping[str, PeerStatus] = dataclasses.field(default_factory=dict)
    progress: Mapping[str, ProgressRecord] = dataclasses.field(default_factory=dict)  # the last read of the records
    check_s: float = 0.0  # our own check of the followed plan (a search of its records; 0: not checked)
    check_short: bool = False  # that search reached its cap, where the leader's goes on (``plan_maker.stopped_short``)
    # the trainers of the followed plan that this agent saw stay away from its epoch past their time (its
    # heartbeat answers said so: ``churn.liveness.no_shows``); the leader's own finding
    no_shows: tuple[str, ...] = ()
    unjudged: tuple[str, ...] = ()  # trainers away from it whose time (the no-show window) still runs

    @property
    def current(self) -> PlanRecord | None:
        """The plan followed, else the newest seen (None before the run's first plan)."""
        return self.following or self.newest_seen


@dataclass
class _Planning:
    """A plan being computed by the leader in the planner thread."""

    epoch: int
    membership: tuple[str, ...]
    devices: list[str]  # cluster order: device i of the plan is peer devices[i]
    spares: list[str]
    cluster: Cluster
    workload: Workload
    trigger: str
    future: concurrent.futures.Future
    replan: Replan | None = None  # None: the run's first plan
    start_step: int = 0
    sources: tuple[str, ...] = ()
    members: Cluster | None = None  # every member's links (trainers in ``devices`` order, then spares)
    step_s: float = 0.0  # the measured step time (0: not measured yet)
    slowdowns: dict[str, float] = dataclasses.field(default_factory=dict)  # claims replaced (``leadership.claims``)
    layers: Layers | None = None  # the split a re-plan keeps (``PlanPricing.split_workload``)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)  # the links rows' versions planned with
    ready: tuple | None = None  # the record made, its store timed out (``Leader._publish_plan``)


def _by_member(planning: _Planning, plan: dict, apart, index: dict[str, int]) -> dict:
    """The plan record's fields that name members by index (``index``): the claims replaced, probation, the pairs
    kept apart (``apart``) and the links rows' versions the leader planned with."""
    return dict(slowdowns=tuple((index[p], f) for p, f in planning.slowdowns.items() if p in index),
                probation=tuple(sorted(index[planning.devices[d]] for d in plan.get("probation", ()))),
                apart=tuple(sorted(tuple(sorted(index[p] for p in pair)) for pair in apart
                                   if all(p in index for p in pair))),
                rows=tuple(planning.rows.get(p, 0) for p in sorted(index, key=index.get)))


class Leader:
    """The leader-only state of one agent, and the leader's moves.

    From the agent it is given: ``config``, the ``dht`` (records read and the plan published), ``events``,
    its ``peer_id``, the ``leaders`` it passed over (shared with its plan gate), ``view`` (what it has seen
    of plans and peers, read at each use: the training thread moves ``done_now``), ``note_waiting`` (one
    log line per change), ``boundary_s`` (the step boundaries' costs, appended while it trains), when
    its loop ``started``, the run's ``stages`` (shared with its plan gate; its own by default) and what its ping
    answers say (``announced``: how long its own search of a first plan took, ``Watching``). It keeps
    the rest: the planner thread, the plan being computed and the last one published, the re-plan watch, its
    judge (``judge``: the quarantine, evidence and blames, the compute each trainer showed), its pricing of
    plans (``pricing``) and its watch of another leader (``Watching``, which shares the planner thread).
    """

    def __init__(self, config: AgentConfig, dht: SwarmDHT, events: EventLog, peer_id: str, leaders: LeaderWatch, *,
                 view: Callable[[], AgentView], note_waiting: Callable[[str], None], boundary_s: Sequence[float],
                 started: float, stages: RunStages | None = None, fetch_evidence: Fetch | None = None,
                 announced: Announced | None = None):
        self.config, self.dht, self.events, self.peer_id = config, dht, events, peer_id
        self._leaders, self._view = leaders, view
        self._note_waiting = note_waiting
        self._started = started
        self._planner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-planner")
        self._planning: _Planning | None = None
        self._next_epoch = 0
        self._published: PlanRecord | None = None  # the last plan this agent published as leader
        self.published_search_s = 0.0  # how long its search took
        self._links_wait = LinksWait()  # the first plan's wait for its trainers' links (shared with ``_watching``)
        self._join_links_since: float | None = None  # a join re-plan waiting for the joiners' links, since
        self._stages = stages or RunStages(config.train)
        self.pricing = PlanPricing(config, lambda: self._view().current, boundary_s)
        self._watching = Watching(config, dht, events, peer_id, leaders, view=view, started=started,
                                  stages=self._stages, planner=self._planner, pricing=self.pricing,
                                  links_wait=self._links_wait, announced=announced)
        self.rows_to_check = self._watching.rows_to_check  # the links rows a follower checks the first plan on
        # stages = "auto", the run's first plan: the stage count being chosen for these members (and whether the
        # choice was said), and the one chosen
        self._choice: tuple[tuple[str, ...], concurrent.futures.Future] | None = None
        self._choice_said, self._chosen = False, typing.cast(int | None, None)
        self._watch = ReplanWatch(config.churn, config.train.rounds)
        self.judge = Judge(config, events, peer_id, dht.keys.run_id, fetch_evidence)  # evidence, blame, quarantine
        self.quarantine = self.judge.quarantine

    @property
    def published(self) -> PlanRecord | None:
        """The last plan this agent published as leader."""
        return self._published

    @property
    def planning(self) -> bool:
        """Whether our planner computes a plan now."""
        return self._planning is not None

    def close(self) -> None:
        """Stop the planner's and the judge's threads; a plan being computed, or a judgement, is dropped."""
        self._planner.shutdown(wait=False, cancel_futures=True)
        self.judge.close()

    # ---- watching the leader (we do not lead): ``watching.Watching`` ------------------------------------

    def watch_leader(self, membership: Membership) -> Membership:
        """``membership`` without the leader once it is passed over (``Watching.watch_leader``)."""
        return self._watching.watch_leader(membership)

    def pass_over(self, leader: str, why: str) -> None:
        """Leave ``leader`` out for its back-off (``Watching.pass_over``)."""
        self._watching.pass_over(leader, why)

    # ---- leading ----------------------------------------------------------------------------------------

    def lead(self, membership: Membership) -> None:
        """One move of the leader, on every poll while we are the lowest live peer in standing of ``membership``
        (the leaders we passed over are never planned, even if the view was read before we did)."""
        membership = membership.without(*(self._leaders.excluded() - {self.peer_id}))
        if self._planning is not None:
            if self._planning.future.done():
                self._publish_plan(self._planning)
            return
        view = self._view()
        current = view.current
        if self._published is not None and (current is None or self._published.epoch > current.epoch):
            return  # our newest plan is not taken up yet
        if current is not None:
            self._replan(current, membership)
            return
        trigger = plan_trigger(view.seen, self.config.membership, time.monotonic() - self._started)
        if trigger is None:
            self._note_waiting(f"leading; waiting for peers: {len(membership)} live"
                               + (f" of {self.config.membership.expect} expected" if self.config.membership.expect else ""))
            return
        order = cluster_order(membership.peers)
        trainers = self._watching.first_trainers(order)
        try:
            rows = self.dht.read_links()
        except ProtocolError as e:
            logger.warning("reading the links rows failed: %s", e)
            return
        # both ends of each pair (a link one end measured is clamped to the best both did: the first plan would
        # not see a fast instance or region that only one end has measured yet)
        graph = probe_set.graph(membership.peers, self.config)
        gaps = link_gaps(trainers, rows, graph)
        if not links_enough(gaps, trainers, graph, self.config.membership.links_missing) and \
                self._links_wait.waited_s() < self.config.membership.links_timeout_s:
            self._note_waiting(f"leading; {trigger}; waiting for {len(gaps)} link measurements of its trainers")
            return
        stages = self._stages.next_plan(None)
        if stages is None:
            stages = self._choose_stages(membership, rows, trigger)
            if stages is None:
                return
        self._chosen = stages
        trainers, spares = trainers_and_spares(order, self.config.train, stages)
        start_step, sources, trigger = self._first_start(trigger, membership, stages)
        self._start_planning(membership, trainers, spares, rows, trigger, None, start_step, sources)

    def _choose_stages(self, membership: Membership, rows, trigger: str) -> int | None:
        """``stages = "auto"``, the run's first plan: the stage count of the checkpoint we resume from (a shared
        dir; our own copies pinned it as the agent started), else the one chosen for these members in the
        planner thread (``run_stages.choose_run_stages``); None while it is being chosen, or if none fits."""
        cfg = self.config
        if cfg.checkpoint.resume and cfg.checkpoint.dir:
            found = stages_on_disk(cfg.checkpoint.dir, cfg.train, complete=True)
            if found is not None:
                self._note_waiting(f"leading; resuming the {found} stages of the checkpoint in {cfg.checkpoint.dir}")
                return found
        if self._choice is None or self._choice[0] != membership.ids:
            future = self._planner.submit(choose_run_stages, cluster_order(membership.peers), membership.peers, rows,
                                          cfg.train, cfg.plan, **self.pricing.measured_costs(membership))
            self._choice, self._choice_said = (membership.ids, future), False
        future = self._choice[1]
        if not future.done():
            self._note_waiting(f"leading; {trigger}; choosing the stage count for {len(membership)} peers")
            return None
        try:
            choice = future.result()
        except ValueError as e:
            self._note_waiting(f"leading; cannot choose the stage count: {e}; waiting for peers")
            return None
        best = choice.best
        options = "; ".join(f"{o.num_stages}: {o.step_s:.4g} s" if o.step_s is not None else
                            f"{o.num_stages}: {o.skipped}" for o in choice.options)
        if best is None:
            self._note_waiting(f"leading; no stage count fits the devices' memory ({options}); waiting for peers")
            return None
        if not self._choice_said:
            self._choice_said = True
            logger.info("chose %d pipeline stages for the run (predicted step per stage count: %s)", best.num_stages,
                        options)
            self.events.write("stages_chosen", stages=best.num_stages, peers=len(membership),
                              options=[{"stages": o.num_stages, "step_s": o.step_s, "skipped": o.skipped}
                                       for o in choice.options])
        return best.num_stages

    def _first_start(self, trigger: str, membership: Membership, stages: int) -> tuple[int, tuple[str, ...], str]:
        """Step 0 from the seed, or with ``checkpoint.resume`` the newest step every stage (of the run's
        ``stages``) has a copy of: on a live member's own disk (their first heartbeats say which), or in the
        shared checkpoint dir."""
        ckpt, train = self.config.checkpoint, at_stages(self.config.train, stages)
        if not ckpt.resume:
            return 0, (), trigger
        try:
            progress = self.dht.read_progress()
        except ProtocolError as e:
            logger.warning("resume: reading the members' copies failed (%s)", e)
            progress = {}
        holdings = {p: copies_of(r.holds) for p, r in progress.items() if p in membership}
        shared = latest_complete(ckpt.dir, train.stages, train.model) if ckpt.dir else None
        restart = restart_point(train.stages, holdings, [shared] if shared is not None else [], train.rounds)
        if restart.step == 0:
            logger.warning("resume: no step has a copy of all %d stages of %s on the live agents' disks%s; "
                           "starting at step 0", train.stages, train.model,
                           f" or in {ckpt.dir}" if ckpt.dir else "")
            return 0, (), trigger
        where = "the checkpoint" if restart.from_checkpoint else "the agents' own copies"
        return restart.step, restart.sources, f"{trigger}; resumed from {where} of step {restart.step}"

    def _replan(self, current: PlanRecord, membership: Membership) -> None:
        settle_s = self.config.dht.peer_ttl_s
        if self._view().following is None and self._published is None and time.monotonic() - self._started < settle_s:
            # A peer that just started (a joiner) has not seen every live peer's record yet: in one record
            # lifetime every live peer refreshed its own.
            self._note_waiting(f"leading; learning who is live ({settle_s:.0f} s) before re-planning")
            return
        try:
            progress = self.dht.read_progress()
        except ProtocolError as e:
            logger.warning("reading progress failed: %s", e)
            return
        self.judge.observe(current, progress)
        judging = self.judge.judge_evidence(current, progress)  # before ``live``: a proven culprit's states are no restart's
        if judging is not None:  # whom the failure is on decides who stays, and from which states
            self._note_waiting(f"leading; {judging}")
            return
        progress = self.judge.without_cleared(progress)
        ckpt, train = self.config.checkpoint, at_stages(self.config.train, self._plan_stages())
        last = latest_complete(ckpt.dir, train.stages, train.model) if ckpt.dir else None
        live = self.quarantine.without(membership.ids)  # a quarantined peer is no joiner before its back-off ends
        view = self._view()
        ours = view.following is not None and view.following.epoch == current.epoch  # the epoch our heartbeats watch
        absent = view.no_shows if ours else ()
        replan = self._watch.check(current, live, progress, train.steps, [last] if last is not None else [],
                                   time.monotonic(), view.done_now, view.statuses, absent)
        if replan is None:
            if self._watch.note:
                self._note_waiting(f"leading; {self._watch.note}")
            return
        if replan.kind == FAILURE and ours and view.unjudged:
            # a trainer that never took the epoch up, whose time runs: our own finding, within seconds, decides
            # whether it is left out now (not waited for, quarantined), not the wait for its halt
            self._note_waiting(f"leading; re-planning epoch {current.epoch}: judging whether "
                               f"{', '.join(view.unjudged)} took it up")
            return
        self.judge.quarantine_culprits(current, replan)
        self.judge.own_finding(current, progress, absent)
        self.judge.count_blames(current, replan)
        # the quarantined stay out, except a peer the restart takes a stage's state from (it holds it; the
        # plan must name it as a member); a live culprit whose back-off ended while this failure could not be
        # re-planned yet (too few peers) is a member again, as a joiner would be
        held = self.quarantine.held() - set(replan.restart.sources if replan.restart else ())
        peers = {p: membership.peers[p] for p in (*replan.members, *replan.culprits)
                 if p in membership.peers and p not in held}
        try:
            # suspects (blamed, disputed or back from a quarantine lately) are the spares where some must be: a
            # member refused on a word may be the rogue, and a stage it trains alone is checked by nobody
            suspects = self.quarantine.suspects() - {self.peer_id}
            base = cluster_order(peers)
            trainers, spares = trainers_and_spares(sorted(base, key=lambda p: p in suspects), train)  # stable sort
            # the trainers themselves in the cluster's order, as a follower orders them for its own plan: planned
            # from another order, the plan kept apart (``kept_apart``, greedy from the plan it starts from) cost
            # 2.6x the follower's on a 2 x 2 grid, and every follower refused it
            chosen = set(trainers)
            trainers = [p for p in base if p in chosen]
        except ValueError as e:
            self._note_waiting(f"leading; cannot re-plan ({replan.reason}): {e}; waiting for peers")
            return
        try:
            rows = self.dht.read_links()
        except ProtocolError:
            rows = {}
        if replan.kind == JOIN and self._joiners_unmeasured(trainers, rows, replan.reason, Membership(peers)):
            return
        restart = replan.restart
        times = [r.step_time_s for r in progress.values() if r.epoch == current.epoch and r.step_time_s > 0]
        self._start_planning(Membership(peers), trainers, spares, rows, replan.reason, replan,
                             restart.step if restart else 0, restart.sources if restart else (),
                             statistics.median(times) if times else 0.0)

    def _joiners_unmeasured(self, trainers: list[str], rows, reason: str, membership: Membership) -> bool:
        """Whether a join re-plan waits for links: until one end at least measured every link between its
        trainers (trainers do not probe while they train; a joiner, idle, measures its own row within seconds),
        or ``links_timeout_s``. Planned blind, a joiner's unmeasured links price every plan alike, and followers
        who read the rows a moment later refuse it (their own plan is cheaper on what they read)."""
        gaps = unmeasured_links(trainers, rows, probe_set.graph(membership.peers, self.config))
        now = time.monotonic()
        if self._join_links_since is None:
            self._join_links_since = now
        if gaps and now - self._join_links_since < self.config.membership.links_timeout_s:
            self._note_waiting(f"leading; {reason}; waiting for {len(gaps)} links of its trainers to be measured")
            return True
        return False

    def _start_planning(self, membership: Membership, trainers: list[str], spares: list[str], rows, trigger: str,
                        replan: Replan | None, start_step: int, sources: tuple[str, ...],
                        step_s: float = 0.0) -> None:
        slowdowns = self.judge.judge_compute(self._view().current, membership)
        membership = Membership(with_slowdowns(membership.peers, slowdowns))
        cluster = build_cluster(trainers, membership.peers, rows, self.config.emulation)
        members = build_cluster(trainers + spares, membership.peers, rows, self.config.emulation) if spares else cluster
        stages = self._plan_stages()
        workload, layers = self.pricing.split_workload(trainers, membership, at_stages(self.config.train, stages))
        logger.info("planning epoch %d for %d peers (%s): %d stages × %d replicas, %d spare(s), strategy %s",
                    self._next_epoch, len(membership), trigger, stages, len(trainers) // stages, len(spares),
                    self.config.plan.strategy)
        epoch = max(self._next_epoch, self._view().max_epoch_seen + 1)
        self.events.write("planning", epoch=epoch, peers=len(membership), trainers=len(trainers), trigger=trigger)
        future = self._planner.submit(make_plan, cluster, workload, stages, self.config.plan)
        self._planning = _Planning(epoch, membership.ids, trainers, spares, cluster, workload, trigger, future,
                                   replan, start_step, sources, members, step_s, slowdowns, layers,
                                   {p: row.version for p, row in rows.items()})

    def _plan_stages(self) -> int:
        """The S of the plan being made: the run's (``RunStages.next_plan``), for an auto run's first plan the
        one this leader chose (``_choose_stages``)."""
        current = self._view().current
        stages = self._stages.next_plan(current) or (current.stages if current is not None else self._chosen)
        assert stages is not None, "the first plan of an auto run is made once its stage count is chosen"
        return stages

    # ---- publishing -------------------------------------------------------------------------------------

    def _publish_plan(self, planning: _Planning) -> None:
        """Store the plan ``planning`` found; where the store timed out, the same record at the next poll (it
        may have landed, members follow it: one made anew, a join's start moved on, is a second plan of one epoch)."""
        self._planning = None
        ready = planning.ready or self._plan_record(planning)
        if ready is None:
            return
        record, plan, start_step, sources = ready
        if not _stored(self.dht, record):
            self._planning = dataclasses.replace(planning, ready=ready)
            return
        self._published = record
        self.published_search_s = float((plan.get("search") or {}).get("seconds") or 0.0)
        self._next_epoch = planning.epoch + 1
        self._links_wait.reset()
        self._join_links_since = None
        self._watch.reset()
        _announce(self.events, self.config.train, planning, plan, start_step, sources)

    def _plan_record(self, planning: _Planning) -> tuple[PlanRecord, dict[str, Any], int, tuple[str, ...]] | None:
        """The record of ``planning``'s plan (None: not published), the plan as announced, start and sources."""
        try:
            plan = planning.future.result()
        except ValueError as e:
            raise AgentError(f"the planner found no plan: {e}") from None
        if planning.layers is not None:  # planned at the split the run trains with
            plan = {**plan, "layers": [list(r) for r in planning.layers]}
        probation = [i for i, p in enumerate(planning.devices) if not self._leaders.standing.proven(p)]
        if probation:  # fresh keys never train a stage alone (``plan_maker.with_company``)
            plan = with_company(plan, planning.cluster, planning.workload, probation, self.config.plan)
            logger.info("peers on probation (no work shown yet): %s", ", ".join(planning.devices[i] for i in probation))
        signer, inherited = self._leaders.standing.kept_apart
        if signer != self.peer_id:  # a predecessor's pairs: apart for their window, never counted
            self.quarantine.inherit(inherited)
        apart = self.quarantine.apart()  # the pairs kept apart: the plan's, and so its record's
        pairs = [(planning.devices.index(a), planning.devices.index(b)) for a, b in map(sorted, apart)
                 if a in planning.devices and b in planning.devices]
        if pairs:  # members that refused each other without evidence never exchange a message again
            plan = kept_apart(plan, planning.cluster, planning.workload, pairs, self.config.plan, probation)
        record = PlanRecord.from_plan_json(planning.epoch, planning.devices + planning.spares, plan)
        start_step, sources = planning.start_step, planning.sources
        if planning.replan is not None and planning.replan.kind == JOIN:
            point = self._join_point(record)
            if point is None:
                logger.warning("not admitting the joiners: a stage of epoch %d has no live trainer left",
                               self._view().current.epoch)
                return
            start_step, sources = point
            if start_step >= self.config.train.steps:
                logger.info("not re-planning (%s): the run ends before the next re-plan point", planning.trigger)
                self._watch.reset()
                return
        strays = [p for p in sources if p not in (CHECKPOINT, INIT) and p not in record.membership]
        if strays:  # a source left between the check and the plan: check again
            logger.warning("not publishing epoch %d: the restart's source(s) %s are no longer members; re-planning",
                           planning.epoch, ", ".join(strays))
            self._watch.reset()
            return
        copies = _warm_copies(self.config, planning, plan)
        index = {p: i for i, p in enumerate(record.membership)}
        if self.peer_id not in index:
            logger.warning("not publishing epoch %d: this leader is not one of its members", planning.epoch)
            self._watch.reset()
            return
        record = dataclasses.replace(record, start_step=start_step, reason=planning.trigger[:120],
                                     leader_at=index[self.peer_id], **_by_member(planning, plan, apart, index),
                                     sources=source_indices(sources, record.membership),
                                     backups=tuple(NO_BACKUP if p is None else index[p] for p in copies["peers"]),
                                     backup_every=copies["every_steps"],
                                     **settings.plan_fields(self.config.train))
        return record, {**plan, "warm_copies": copies}, start_step, tuple(sources)

    def _join_point(self, record: PlanRecord) -> tuple[int, tuple[str, ...]] | None:
        """A join re-plan's start (``restart.join_start``) and sources: each stage's lowest-replica trainer of
        the epoch being trained (every one of them stops at that step, holding it)."""
        current = self._view().current
        try:
            progress = self.dht.read_progress()
        except ProtocolError:
            progress = {}
        seen = [r.step for r in progress.values() if r.epoch == current.epoch]
        done_now = self._view().done_now
        if done_now is not None:
            seen.append(done_now)
        sources = []
        for stage in range(current.stages):
            holders = [current.peer_at(i, stage) for i in range(current.replicas)]
            live = [p for p in holders if p in record.membership]
            if not live:
                return None  # a failure, not a join: the halted heartbeats will say where to restart
            sources.append(live[0])
        return join_start(seen, current.start_step, self.config.train.rounds), tuple(sources)


def _warm_copies(cfg: AgentConfig, planning: _Planning, plan: dict[str, Any]) -> dict[str, Any]:
    """Who keeps each stage's warm copy, and how often (``leader.warm_copies``); the step time is the
    one measured in the last epoch, else the plan's prediction plus the slowest trainer's compute."""
    scale = cfg.emulation.time_scale if cfg.emulation.enabled else 1.0
    if isinstance(planning.workload, LayeredWorkload):  # mixed devices: the prediction includes compute
        step_s = planning.step_s or plan["cost_s"] * scale
    else:
        step_s = planning.step_s or plan["cost_s"] * scale + compute_estimate_s(
            cfg.train, plan["stages"], plan["replicas"], min(d.tflops for d in planning.cluster.devices))
    churn = cfg.churn
    # until a step was measured, copy within the first few steps (a copy's cost is a guess then) -- but not
    # where homes' uplinks carry them: there a copy shares the line the pipeline's own traffic takes
    if not planning.step_s and churn.backup_every == "auto" and not planning.cluster.has_access_links:
        churn = dataclasses.replace(churn, backup_max_every=min(churn.backup_max_every, churn.backup_first_every))
    copies = warm_copies(plan, planning.devices, planning.spares, planning.members or planning.cluster,
                         stage_state_bytes(cfg.train, plan["stages"]), step_s, churn, cfg.emulation,
                         cfg.train.rounds.length)
    logger.info("warm copies every %d step(s) (one copy %.3f s, %.4f s per step) to %s", copies["every_steps"],
                copies["copy_s"], copies["per_step_s"], copies["peers"])
    return copies


def _stored(dht: SwarmDHT, record: PlanRecord) -> bool:
    """Store ``record``; False where the DHT did not take it in time (a DHT too busy to answer, as with 32 agents
    on two cores), logged: the leader publishes it again at its next poll, never ends for it."""
    try:
        dht.publish_plan(record)
    except ProtocolError as e:
        logger.warning("publishing plan epoch %d failed (%s); publishing it again at the next poll", record.epoch, e)
        return False
    return True


def _announce(events: EventLog, train: TrainConfig, planning: _Planning, plan: dict[str, Any], start_step: int,
              sources: Sequence[str]) -> None:
    """The published plan in the log (prediction, baselines, how it was found) and in the events file."""
    baselines = ", ".join(f"{k} {v['cost_s']:.3f} s" for k, v in plan.get("baselines", {}).items())
    search = plan.get("search") or {}
    method = search.get("method", "?")
    # a fixed order (strategy megatron or random) has no search time
    how = (f"planned in {search['seconds']:.2f} s by the {method} search" if search.get("seconds") is not None
           else f"placed in the {method} order")
    logger.info("published plan epoch %d: predicted %.3f s/step (%s); pipelines %s; %s%s", planning.epoch,
                plan["cost_s"], baselines, plan["pipelines"], how,
                f" ({search['fallback']}'s order: the search did not beat it)" if search.get("fallback") else "")
    events.write(
        "plan", epoch=planning.epoch, plan=plan, devices=planning.devices, spares=planning.spares,
        trigger=planning.trigger, cluster=planning.cluster.to_dict(), estimated=_estimated_pairs(planning.cluster),
        start_step=start_step,
        sources=list(sources), replan=planning.replan.kind if planning.replan else None,
        slowdowns=planning.slowdowns, settings=settings.plan_fields(train), rows=planning.rows,
        workload={"activation_gb": planning.workload.activation_gb, "gradient_gb": planning.workload.gradient_gb,
                  **({"step": dataclasses.asdict(planning.workload.step)}
                     if isinstance(planning.workload, StepWorkload) else {}),
                  **({"layer_costs": dataclasses.asdict(planning.workload.costs)}
                     if isinstance(planning.workload, LayeredWorkload) else {})},
    )


def _estimated_pairs(cluster: Cluster) -> list[list[int]]:
    """The device pairs (i < j) whose links the plan's cluster estimated (``planning.estimated``)."""
    if cluster.estimated is None:
        return []
    return [[int(i), int(j)] for i, j in zip(*np.nonzero(np.triu(cluster.estimated, 1)), strict=True)]
