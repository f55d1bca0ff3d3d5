"""Open runs, protected as far as they can be: a plan is checked before it is followed, and a leader that
publishes no valid plan in time is passed over. Pure (no I/O; clocks are arguments).

Lowest-ID election lets anyone lead who generates keys until one sorts first (closed runs refuse such peers at
admission, ``dht.admission``; an admitted peer can still be broken). So a follower does not take the leader's
word for a plan:

* ``membership_problem``: the plan names only peers the follower sees live, and a first plan leaves out none
  that the follower has seen for a while (a later plan may: peers that did not halt in time, or joiners who wait
  for the next re-plan point).
* the stage count (``run_stages``): a plan has the run's S, or with ``stages = "auto"`` one within the run's
  bounds whose stage for this follower fits its device's memory, and once the run's S is pinned (the first plan
  the follower trained, or its own copies on disk) that one.
* ``cost_problem``: the follower plans the same records itself (the scheduler is deterministic with the run's
  seed; stopped after ``plan.verify_device_evaluations`` over the devices, ``plan_maker.check_search``, so that
  its work is bounded at any size), scores the leader's assignment and its own with the same objective on the
  same measured links (the rows as they stood when the leader planned, ``PlanRecord.rows`` and
  ``rows_as_planned``; from a leader that does not say, for the run's first plan, the rows its own search read
  when the plan fell due, ``Watching.rows_to_check``), and refuses the leader's if it is more than ``tolerance``
  (a fraction) plus ``slack_s`` slower. Both are scored on the follower's inputs, so links re-measured since the
  leader planned move both figures alike; the slack covers short steps (loopback), where link noise alone moves
  the two plans' costs by more than the tolerance. Only the plan's checkers make that search (``checkers``:
  ``plan.checkers`` members chosen by the run and the leader); the other members follow once every checker's
  progress record names the plan, and check it themselves when that does not come in time.
* ``LeaderWatch``: once a plan is *due* (from the follower's own view: the plan trigger fired and the links are
  measured, or an epoch it trained halted), the leader has ``grace_s`` (plus the search budget) to publish a
  plan that passes both checks; otherwise the follower passes it over: it leaves the follower's view of the
  members for a back-off that doubles with each repeat, so the next-lowest peer leads and the plans leave it
  out. A peer passed over by mistake (a slow honest leader) rejoins after its back-off like any joiner.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from p2ptrain.agent.churn.replan import BLAMED_HALT_S, blame_roots, refusals_of
from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership import settings
from p2ptrain.agent.leadership.checkers import checkers, vouched
from p2ptrain.agent.leadership.claims import plan_slowdowns, with_slowdowns
from p2ptrain.agent.leadership.plan_maker import (
    build_cluster,
    cluster_order,
    kept_apart,
    make_plan,
    stopped_short,
    trainers_and_spares,
    with_company,
)
from p2ptrain.agent.leadership.run_stages import RunStages, at_stages, memory_problem
from p2ptrain.agent.leadership.standing import Standing
from p2ptrain.net.dht.records import LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.dht.row_history import RowHistory
from p2ptrain.net.transport.status import TAKE, PeerStatus
from p2ptrain.planning import Cluster, LayeredWorkload, Workload, even_layers, make_objective
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.verify.attest import judge_evidence
from p2ptrain.verify.evidence import is_bulk_evidence
from p2ptrain.verify.sketch import FALSE_ALARM

logger = logging.getLogger(__name__)

# (cluster, trainers, their records, the run settings) -> the workload a plan of them is scored with
WorkloadFor = Callable[[Cluster, list[str], Mapping[str, PeerRecord], TrainConfig], Workload]


def membership_problem(plan: PlanRecord, live: Collection[str], settled: Collection[str], first: bool,
                       needed: int = 1) -> str | None:
    """Why ``plan`` does not plan the membership we see (None: it does).

    ``live``: the peers we see live (dead and passed-over peers already left out); ``settled``: those of
    them we have seen long enough that a leader must have seen them too; ``first``: no epoch was trained
    yet, so every settled live peer must be a member (``first_plan_problem``, with ``needed``).
    """
    unknown = [p for p in plan.membership if p not in live]
    if unknown:
        return f"it names {len(unknown)} peer(s) we do not see live ({', '.join(unknown[:3])})"
    return first_plan_problem(plan, live, settled, needed) if first else None


def first_plan_problem(plan: PlanRecord, live: Collection[str], settled: Collection[str], needed: int) -> str | None:
    """Why ``plan``, the run's first, leaves out peers an honest leader would have planned (None: it does
    not): it names fewer members than the run waits for (``needed``: ``membership.expect``, else
    ``min_peers``; an honest leader plans once that many are live, and plans them all) while we see that
    many live, or it leaves out a ``settled`` live peer."""
    if len(plan.membership) < min(needed, len(live)):
        return (f"it plans {len(plan.membership)} members where the run waits for {needed} and we see "
                f"{len(live)} live")
    missing = sorted(p for p in settled if p not in plan.membership)
    if missing:
        return f"it leaves out {len(missing)} live peer(s) ({', '.join(missing[:3])})"
    return None


def trainers_of(plan: PlanRecord) -> list[str]:
    """The plan's trainers in row-major (pipeline, stage) order."""
    return [plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)]


def assignment_of(plan: PlanRecord, order: Sequence[str]) -> np.ndarray:
    """The plan's (pipeline × stage) assignment as indices into ``order`` (a cluster's device order)."""
    index = {p: k for k, p in enumerate(order)}
    return np.array([[index[plan.peer_at(i, j)] for j in range(plan.stages)] for i in range(plan.replicas)])


@dataclass(frozen=True)
class CostCheck:
    """The leader's plan and ours, scored alike on our inputs (seconds per step)."""

    theirs_s: float
    ours_s: float
    tolerance: float
    slack_s: float = 0.0
    stopped_short: bool = False  # our search reached the check's cap (``plan_maker.stopped_short``)
    search_s: float = 0.0  # how long our search took, as its plan says (one this process made before included)

    @property
    def problem(self) -> str | None:
        if self.theirs_s <= self.ours_s * (1.0 + self.tolerance) + self.slack_s + 1e-9:
            return None
        return (f"it predicts {self.theirs_s:.4g} s per step on the measured links; our own plan of the same "
                f"records predicts {self.ours_s:.4g} s ({self.theirs_s / self.ours_s:.2f}x, more than "
                f"{1 + self.tolerance:.2f}x and {self.slack_s:g} s)")


def rows_as_planned(plan: PlanRecord, rows: Mapping[str, LinksRecord],
                    history: RowHistory | None = None) -> dict[str, LinksRecord]:
    """The members' links rows as they stood when ``plan``'s leader planned (``PlanRecord.rows``, versions): each
    the very version where ``history`` holds it (the rows we read lately), else ``rows``' (the latest) or a
    later one held, cut back to the entries it had then (``LinksRecord.as_of``), else an earlier one held
    (``RowHistory.as_planned``); without the rows the leader did not have. Rows of non-members are left out. A plan
    that names no versions: ``rows`` as they are."""
    if not plan.rows:
        return dict(rows)
    history = history or RowHistory(0)
    kept = {}
    for peer, version in zip(plan.membership, plan.rows, strict=True):
        if (row := history.as_planned(peer, version, rows.get(peer))) is not None:
            kept[peer] = row
    return kept


def cost_check(plan: PlanRecord, peers: Mapping[str, PeerRecord], rows: Mapping[str, LinksRecord],
               train: TrainConfig, config: PlanConfig, emulation: EmulationSettings,
               workload_for: WorkloadFor, tolerance: float, slack_s: float = 0.0,
               proven: Callable[[str], bool] | None = None) -> CostCheck:
    """Score ``plan`` and our own plan of its members (``peers``: their records; ``rows``: the links rows)
    with the run's objective and settings (``agent.settings``: the wire, schedule and overlap both plans
    train with; a plan that departs from them is refused); ``workload_for(cluster, trainers, peers, train)`` gives the workload both
    are scored with. ``train.stages`` is the run's S (``run_stages.at_stages``: the plan's, for an auto run
    whose gate accepted its S). With ``proven`` (who has shown work, ``Standing.proven``) our own plan keeps the
peers on probation company (``plan_maker.with_company``), scored as the dearer of our view of who is on probation
and the plan's (``PlanRecord.probation``); and the pairs the plan keeps apart (``PlanRecord.apart``,
disputes the leader counted) apart alike (``plan_maker.kept_apart``): a leader can inflate a plan's cost with
pairs it names, no more than a swap per pair. Raises ValueError where we cannot plan these members
ourselves."""
    if plan.stages != train.stages:
        raise ValueError(f"it has {plan.stages} stages; the run trains {train.stages}")
    why = settings.problem(plan, train)
    if why is not None:
        raise ValueError(why)
    theirs = trainers_of(plan)
    cluster = build_cluster(theirs, peers, rows, emulation)
    workload = workload_for(cluster, theirs, peers, train)
    if isinstance(workload, LayeredWorkload):  # mixed devices: their plan at its own layer split
        workload = workload.at(plan.layer_ranges or even_layers(workload.costs.num_layers, plan.stages))
    theirs_s = make_objective(config.objective, cluster, workload, plan.stages).evaluate(
        assignment_of(plan, theirs)).cost_s
    ours, _ = trainers_and_spares(cluster_order({p: peers[p] for p in plan.membership}), train)
    if len(ours) != len(theirs):
        raise ValueError(f"it trains {len(theirs)} peers where the run's settings train {len(ours)} of "
                         f"{len(plan.membership)} members")
    own = build_cluster(ours, peers, rows, emulation)
    own_workload = workload_for(own, ours, peers, train)
    base = make_plan(own, own_workload, plan.stages, config, check=True)
    pairs = [(ours.index(a), ours.index(b)) for a, b in map(sorted, plan.kept_apart) if a in ours and b in ours]
    ours_s = 0.0
    # who is on probation, as we read it and as the leader did (``PlanRecord.probation``): the two views differ
    # for a while after an epoch's first steps (the progress records are read every few seconds), and keeping a
    # peer company may make a plan cheaper as well as dearer; scored with the dearer of the two, an honest leader
    # that read the records a moment before us is not refused (the cost check never enforced the company itself:
    # a plan without it is no dearer)
    views = {tuple(i for i, p in enumerate(ours) if proven is not None and not proven(p)),
             tuple(sorted(ours.index(p) for p in plan.on_probation if p in ours))}
    for fresh in sorted(views):
        own_plan = with_company(base, own, own_workload, fresh, config)  # the base plan where nobody is fresh
        if pairs:  # the pairs the leader keeps apart (disputes it counted): our plan alike, or theirs costs more
            own_plan = kept_apart(own_plan, own, own_workload, pairs, config, fresh)
        ours_s = max(ours_s, own_plan["cost_s"])
    search = base.get("search") or {}
    return CostCheck(float(theirs_s), float(ours_s), tolerance, slack_s, stopped_short(search, config, len(ours)),
                     float(search.get("seconds") or 0.0))


def culpable_leader(plan: PlanRecord, progress: Mapping[str, ProgressRecord], blamed_for_s: float,
                    run: str | None = None, false_alarm: float = FALSE_ALARM) -> str | None:
    """Why the leader of ``plan`` failed its own epoch (None: nothing says so yet): the halted trainers' blames
    (``ProgressRecord.blame``) end at it (``replan.blame_roots``): its stage took tensors and answered nothing,
    or a check of a member's found its work wrong. Until it halted itself (saying whom it waited on, if anyone)
    it gets ``BLAMED_HALT_S`` from the first such blame (``blamed_for_s`` ago), as a blamed trainer does from
    its leader. An honest leader at the root of a cascade (its link broke) is passed over for one back-off and
    rejoins like any joiner: the leader that would have planned around the failure was itself.

    Accusations are taken in their order (``docs/trust.md``): a blame with evidence is judged first, as the
    leader judges it (with ``run``; ``verify.attest.judge_evidence``): evidence that holds against the leader
    makes it culpable at once (its own work failed a check), and the blames of a peer whom evidence that holds
    accuses are void; evidence that does not hold is no blame at all (a liar's word must not pass an honest
    leader over, and make the liar, next in line, the leader of those who believed it). Bulk evidence (a failed
    recompute's, a shard dispute's) is not judged here (its bulk goes to the leader, ``verify.evidence``): its
    blame of another member is the finder's word, its blame of the leader is no blame here. Then a peer the leader itself
    refused (its halted record says a check of the leader's found the peer's work wrong) cannot get the leader
    passed over: its blame of the leader is its word against the leader's, and the leader decides whom it
    plans; nor can a peer another member refused (its word against its finder's: a caught member that blames
    the leader back, to shield itself). The rest are words, ordered by ``blame_roots``: a refusal names a
    cause, a failed call a cascade."""
    halted = {p: r for p, r in progress.items() if r.epoch == plan.epoch and r.halted and p in plan.membership}
    void: set[str] = set()  # peers whose blames do not count
    if run is not None:
        judged = {p: _judge(r.evidence, r.blame, run, false_alarm) for p, r in halted.items()
                  if r.evidence and r.blame and not is_bulk_evidence(r.evidence)}
        if any(why is None and halted[p].blame == plan.leader for p, why in judged.items()):
            return f"epoch {plan.epoch}, which it planned: its own work failed a check (proven by its signed statement)"
        void = {halted[p].blame for p, why in judged.items() if why is None}  # proven culprits
        # nor is bulk evidence against the leader (its bulk goes to the leader, which judges it): a liar's
        # must not pass an honest leader over, and nothing the leader did is kept meanwhile (the step is refused)
        halted = {p: r for p, r in halted.items() if judged.get(p) is None
                  and not (r.evidence and is_bulk_evidence(r.evidence) and r.blame == plan.leader)}
    own = halted.get(plan.leader)
    if own is not None and own.refused and own.blame is not None:
        void |= {own.blame, *own.also}  # caught by the leader's own check: its word against the leader's does not count
    # refused by another member's check: its word is contested by its finder's, and cannot pass the leader over
    # while it stands accused (a member caught by a non-leader that blames the leader back)
    void |= {p for r in halted.values() if r.refused and r.blame is not None for p in (r.blame, *r.also)} - {plan.leader}
    halted = {p: r for p, r in halted.items() if p not in void}
    edges = {p: r.blame for p, r in halted.items() if r.blame in plan.membership and r.blame != p}
    roots = blame_roots(edges, refusals_of(halted))
    if plan.leader not in roots or (plan.leader not in halted and blamed_for_s < BLAMED_HALT_S):
        return None
    return (f"epoch {plan.epoch}, which it planned, failed at its own stage (the failed calls of "
            f"{sum(1 for b in edges.values() if b == plan.leader)} trainer(s) blame it)")


@functools.lru_cache(maxsize=256)
def _judge(evidence: bytes, accused: str, run: str, false_alarm: float) -> str | None:
    return judge_evidence(evidence, accused, run, false_alarm)  # a signature check and a sketch sum: once each


class CulpableWatch:
    """A follower's watch on the leader of the epoch it followed (``culpable_leader``), once that epoch failed:
    remembers when the blames first ended at the leader, and reads the progress records at most every
    ``interval_s``; with ``run``, blames with evidence are judged."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic, run: str | None = None,
                 false_alarm: float = FALSE_ALARM):
        self.run, self.false_alarm = run, false_alarm
        self.interval_s = interval_s
        self.clock = clock
        self._blamed: dict[tuple[str, int], float] = {}  # (leader, epoch) -> when its blame was first read
        self._last = -float("inf")

    def check(self, plan: PlanRecord, read_progress: Callable[[], Mapping[str, ProgressRecord]]) -> str | None:
        now = self.clock()
        if now - self._last < self.interval_s:
            return None
        self._last = now
        progress = read_progress()
        key = (plan.leader, plan.epoch)
        judging = {"run": self.run, "false_alarm": self.false_alarm}
        if culpable_leader(plan, progress, blamed_for_s=float("inf"), **judging) is None:
            self._blamed.pop(key, None)
            return None
        return culpable_leader(plan, progress, now - self._blamed.setdefault(key, now), **judging)


def halts_settled(plan: PlanRecord, live: Collection[str], progress: Mapping[str, ProgressRecord], steps: int) -> bool:
    """Whether every live trainer of ``plan`` says it halted its epoch (or trained every step), with no bulk
    evidence among them for the leader to judge (a failed recompute's, a shard dispute's): its re-plan waits for
    nothing more than its own search (``replan.ReplanWatch``), so a follower gives it that and the grace, not the
    halts' and the evidence's deadlines (``Leader.watch_leader``)."""
    trainers = [p for p in dict.fromkeys(trainers_of(plan)) if p in live]
    records = [progress.get(p) for p in trainers]
    if not trainers or not all(r is not None and r.epoch == plan.epoch and (r.halted or r.step >= steps)
                               for r in records):
        return False
    return not any(r.evidence and is_bulk_evidence(r.evidence) for r in records)


def newer_plan_excuses(newest: PlanRecord | None, followed_epoch: int, leader: str, live: Collection[str]) -> bool:
    """Whether a plan newer than the one we followed stops the clock on ``leader`` (we wait for a re-plan
    point like any joiner: a plan came, we are just not in it). Only a plan signed by ``leader`` itself, or by
    a peer no longer live (a leader that died after planning), does: a newer plan signed by another live
    peer ranks that peer after ``leader`` (the leader is the lowest live peer in standing), so it comes from followers
    who passed ``leader`` over a moment before we did, and ``leader`` still owes us a plan. Without the
    clock we would wait on a silent leader for ever, and ignore the plan everyone else trains."""
    if newest is None or newest.epoch <= followed_epoch:
        return False
    return newest.leader == leader or newest.leader not in live


GRACE_READS = 4.0  # a leader's grace: this many of our slowest recent DHT reads (``LeaderWatch.grace_s``)
CHECKING_WAIT = 4.0  # a member waits up to this many ``plan.time_budget_s`` for checkers that say they still check
READS_KEPT = 16


@dataclass
class _Leader:
    peer: str
    since: float  # when the plan became due under this leader
    succeeds: bool = False  # it leads because we passed over its predecessor a moment ago


class LeaderWatch:
    """Which leaders this agent passed over, and whether the present one is out of time; ``standing``: who
    may lead (``leadership.standing``), where a passed-over leader owes the epochs of its back-off."""

    def __init__(self, grace_s: float, backoff_s: float, max_backoff_s: float = 86400.0,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None):
        # the grace: ``grace_s`` at most; with ``poll_s``, paced by the control plane (``observe_read``)
        self.max_grace_s, self.poll_s = grace_s, poll_s
        self._reads_s: collections.deque[float] = collections.deque(maxlen=READS_KEPT)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self._due: _Leader | None = None
        self._passed_at = -math.inf  # when we last passed a leader over
        self._until: dict[str, float] = {}  # peer -> passed over until
        self._times: dict[str, int] = {}  # peer -> how often passed over
        self.standing = Standing()

    @property
    def grace_s(self) -> float:
        """What a leader gets beyond its search to publish a plan that fell due: its own poll, its read of the
        records, its store of the plan and our poll and read of it. Paced by the control plane as we see it:
        ``GRACE_READS`` times the slowest of our last DHT reads (``observe_read``), at least two polls and a
        second, at most ``[membership] leader_grace_s``. Without ``poll_s``, that maximum."""
        if self.poll_s is None:
            return self.max_grace_s
        slowest = max(self._reads_s, default=self.max_grace_s / GRACE_READS)
        return min(self.max_grace_s, max(2 * self.poll_s + 1.0, GRACE_READS * slowest))

    def observe_read(self, seconds: float) -> None:
        """How long one of our DHT reads of the run's records took (the pace ``grace_s`` follows)."""
        self._reads_s.append(seconds)

    def due_since(self, leader: str, now: float) -> float:
        """When the plan fell due under ``leader`` (``waiting``), else ``now``."""
        return self._due.since if self._due is not None and self._due.peer == leader else now

    def excluded(self) -> set[str]:
        """The peers passed over now (their back-off runs)."""
        now = self.clock()
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]
            logger.info("peer %s's back-off as a passed-over leader ended; it may lead again", peer)
        return set(self._until)

    def waiting(self, leader: str | None, due: bool, allowance_s: float = 0.0) -> str | None:
        """Call on every idle poll while we have no plan to follow: ``due`` whether a plan should have come
        by now (``allowance_s``: what the leader may still spend, e.g. its search budget). Returns the
        leader to pass over, once out of time, or None."""
        now = self.clock()
        if leader is None or not due:
            self._due = None
            return None
        if self._due is None or self._due.peer != leader:
            self._due = _Leader(leader, now, succeeds=now - self._passed_at <= self.max_grace_s)
            return None
        # a successor learns that it leads only when it passes its predecessor over itself, after its own grace
        # (up to the maximum: ours is paced by our reads, its by its own): the difference is its time too (a
        # follower with a fast read passed over the next leader as it published, under CI load)
        succession = self.max_grace_s - self.grace_s if self._due.succeeds else 0.0
        if now - self._due.since <= self.grace_s + allowance_s + succession:
            return None
        self._due = None
        return leader

    def satisfied(self) -> None:
        """A valid plan came: the clock of the present leader stops."""
        self._due = None

    def pass_over(self, peer: str) -> float:
        """Leave ``peer`` out for its back-off (doubling with each repeat), and out of standing until it trained
        the epochs it owes (``Standing.passed_over``: doubling too); returns the back-off in seconds."""
        times = self._times.get(peer, 0)
        self._times[peer] = times + 1
        self._passed_at = self.clock()
        self.standing.passed_over(peer, times + 1)
        backoff = min(self.max_backoff_s, self.backoff_s * 2**times)
        self._until[peer] = self.clock() + backoff
        return backoff


class PlanGate:
    """A follower's checks of the leader's plans, and its watch on the leader; the agent passes in what it
    reads (``read_rows``) and how it scores (``workload_for``). Logs each refusal once, with its reason."""

    def __init__(self, me: str, train: TrainConfig, plan: PlanConfig, emulation: EmulationSettings,
                 leaders: LeaderWatch, settle_s: float,
                 read_rows: Callable[[], Mapping[str, LinksRecord]],
                 workload_for: WorkloadFor,
                 on_refusal: Callable[[PlanRecord, str], None] = lambda plan, reason: None,
                 pass_over: Callable[[str, str], None] = lambda leader, why: None, needed: int = 1,
                 stages: RunStages | None = None,
                 rows_for: Callable[[PlanRecord], Mapping[str, LinksRecord] | None] = lambda plan: None,
                 history: RowHistory | None = None, run: str = "",
                 vouchers: Callable[[], tuple[Mapping[str, ProgressRecord], float]] | None = None,
                 statuses: Callable[[], Mapping[str, PeerStatus]] = dict):
        self.me, self.train, self.plan, self.emulation = me, train, plan, emulation
        self.run = run  # the run's name: whom each plan's checkers are (``checkers``)
        # the progress records read last, and how often they are read (None: we check every plan ourselves)
        self.vouchers = vouchers
        self.statuses = statuses  # what each peer we ping says in its answers (``PeerStatus``: refused, take)
        self._vouch_since: dict[bytes, float] = {}  # a plan we leave to its checkers -> when we first saw it
        self._own_check: set[bytes] = set()  # plans we check ourselves after all
        self._taking_at: dict[bytes, float] = {}  # a plan -> when a checker last said it takes its epoch up
        self.stages = stages or RunStages(train)  # the run's S (the agent's, shared with its leader's side)
        self.leaders, self.settle_s, self.read_rows = leaders, settle_s, read_rows
        self.rows_for = rows_for  # the rows to check a plan on, where not read afresh (``Watching.rows_to_check``)
        self.history = history  # the rows read lately, by version (``SwarmDHT.rows_read``)
        self.workload_for, self.on_refusal, self.pass_over = workload_for, on_refusal, pass_over
        self.needed = needed  # members the run waits for before its first plan (``first_plan_problem``)
        self._costs: dict[bytes, str | None] = {}  # a plan's encoding -> why its cost is refused (None: fine)
        self._refused: set[tuple[bytes, str]] = set()
        self._refused_keys: set[bytes] = set()  # plans refused for what they plan (a later view may accept them)
        self._unseen_since: dict[bytes, float] = {}
        self._check_s: dict[bytes, float] = {}  # a plan's encoding -> seconds its cost check took (our own search)
        self._check_short: dict[bytes, bool] = {}  # ... and whether that search reached its cap

    def refused(self, plan: PlanRecord) -> bool:
        """Whether ``plan`` stands refused (a refused plan never counts as the run's newest)."""
        key = plan.encode()
        return self._costs.get(key) is not None or key in self._refused_keys

    def accept(self, plan: PlanRecord, live: Mapping[str, PeerRecord], known_for: Callable[[str], float],
               first: bool) -> bool:
        """Whether to follow ``plan`` (signed by the leader we see) now. Our own plans pass unchecked."""
        if plan.leader == self.me:
            return True
        key = plan.encode()
        unknown = settings.problem(plan, self.train)  # checked even unverified: the run's settings are pinned
        if unknown is None and self.stages.auto:  # so is an auto run's S, once it has one; and our stage must fit
            record = live.get(self.me)
            unknown = self.stages.problem(plan.stages) or memory_problem(
                plan, self.me, record.memory_gb if record is not None else None, self.train)
        if unknown is not None:
            self._costs[key] = unknown
            self._refuse(plan, key, unknown)
            return False
        if not self.plan.verify:
            return True
        settled = [p for p in live if known_for(p) >= self.settle_s]
        problem = membership_problem(plan, live, settled, first, self.needed)
        if problem is not None and any(p not in live for p in plan.membership):
            # our view may lag the leader's by a poll or two: refuse only if it stays so
            since = self._unseen_since.setdefault(key, self.leaders.clock())
            if self.leaders.clock() - since < self.settle_s:
                return False
        if problem is None:
            if (vouched := self._vouched(plan, key)) is None:
                return False  # its checkers have not all said they train it yet
            problem = None if vouched else self._cost_problem(plan, live, key)
            if problem is None and key not in self._costs:
                return False  # not yet checked (the links rows could not be read): retried at the next poll
        if problem is None:
            self._refused_keys.discard(key)
            self.leaders.satisfied()
            return True
        self._refuse(plan, key, problem)
        return False

    def awaits_word(self, plan: PlanRecord) -> bool:
        """Whether we wait for ``plan``'s checkers to say they train it (``_vouched``): we are taking it up."""
        key = plan.encode()
        return key in self._vouch_since and key not in self._costs and key not in self._own_check

    def lag_s(self, plan: PlanRecord, own_s: float | None = None) -> float:
        """How much later than us a trainer of ``plan`` may take it up, beyond the heartbeats' timeouts: what it cost
        us (``own_s``, else ``check_s``: our search, or the wait for the checkers' word), and where members follow it on
        its checkers' word, what they take to read it (two reads of the progress records apart, and the control
        plane's pace, ``LeaderWatch.grace_s``: 16 agents, members that followed on the word took it up 8 s after a
        checker, whose window was 8.7 s)."""
        own = self.check_s(plan) if own_s is None else own_s
        if self.vouchers is None or len(checkers(plan.membership, plan.leader, self.run, self.plan.checkers)) >= len(
                plan.membership) - 1:
            return own
        return own + 2.0 * self.vouchers()[1] + self.leaders.grace_s

    def check_s(self, plan: PlanRecord) -> float:
        """How long our check of ``plan``'s cost took: our own search of its records, also where we made it before
        (0: not checked)."""
        return self._check_s.get(plan.encode(), 0.0)

    def check_of(self, plan: PlanRecord) -> tuple[float, bool]:
        """``check_s``, and whether that search reached its cap, where the leader's goes on
        (``plan_maker.stopped_short``)."""
        return self.check_s(plan), self._check_short.get(plan.encode(), False)

    def left_out(self, plan: PlanRecord, live: Collection[str], known_for: Callable[[str], float],
                 untrained: Callable[[], bool], watched: Collection[str] | None = None) -> bool:
        """Whether to refuse the leader's ``plan``, which leaves this agent out (and pass the leader over): it is
        the run's first (it starts at step 0, and ``untrained()``: nobody trained a step yet) and leaves out peers an
        honest leader would have planned (``first_plan_problem``). A later plan may leave us out: we wait for
        its re-plan point like any joiner. ``watched``: the peers our heartbeats ping (None: every live one); a
        peer we do not ping may be dead for all we know, so leaving it out is no fault we can see (its own
        partners ping it, and judge that)."""
        if plan.leader == self.me or not self.plan.verify or plan.start_step != 0:
            return False
        settled = [p for p in live if known_for(p) >= self.settle_s and (watched is None or p in watched)]
        problem = first_plan_problem(plan, live, settled, self.needed)
        if problem is not None and untrained():
            self._refuse(plan, plan.encode(), problem)
            return True
        return False

    def _refuse(self, plan: PlanRecord, key: bytes, problem: str) -> None:
        """Refuse ``plan`` and pass its leader over at once (it owes us a plan we accept, and has shown it will
        not give one in time: waiting out the grace would only stall the run). Logged once per plan and reason."""
        if (key, problem) not in self._refused:
            self._refused.add((key, problem))
            logger.warning("refusing plan epoch %d signed by %s: %s", plan.epoch, plan.leader, problem)
            self.on_refusal(plan, problem)
        self._refused_keys.add(key)
        self.pass_over(plan.leader, f"its plan epoch {plan.epoch} was refused")

    def _vouched(self, plan: PlanRecord, key: bytes) -> bool | None:
        """True once every one of ``plan``'s checkers says it trains it; None while we wait; False where we check it
        ourselves: we are a checker, none are chosen, we checked it already, a checker names another plan of its
        epoch and signer or its heartbeat answer says it refused one (``PeerStatus.refused``), or we waited
        ``plan.time_budget_s``: up to ``CHECKING_WAIT`` times that while one says it still takes the epoch up (its
        search runs; 32 agents on two cores: the checkers outlasted the budget, and 27 members searched beside them)."""
        if self.vouchers is None or key in self._costs or key in self._own_check:
            return False
        chosen = checkers(plan.membership, plan.leader, self.run, self.plan.checkers)
        if self.me in chosen or not chosen:
            return False
        verdict, said = vouched(plan, self.vouchers()[0], chosen), self.statuses()
        refusing = sorted(c for c in chosen if c in said and said[c].refused >= plan.epoch) if verdict is None else []
        verdict = False if refusing else verdict  # a checker's heartbeat says it refused a plan of this epoch
        since = self._vouch_since.setdefault(key, self.leaders.clock())
        if verdict:
            self._costs[key], self._check_short[key] = None, True  # no search of ours: a leader gets the budget
            self._check_s[key] = self.leaders.clock() - since  # what taking it up cost us: the wait for the word
            logger.info("plan epoch %d signed by %s followed on the word of its %d checkers (%s)", plan.epoch,
                        plan.leader, len(chosen), ", ".join(sorted(chosen)))
            return True
        waited_s, budget_s = self.leaders.clock() - since, self.plan.time_budget_s
        if any(said[c].state == TAKE and said[c].epoch == plan.epoch for c in chosen if c in said):
            self._taking_at[key] = self.leaders.clock()  # then two reads of the progress records for its word
        if verdict is None and (waited_s < budget_s or (waited_s < CHECKING_WAIT * budget_s and self.leaders.clock()
                                                        - self._taking_at.get(key, -math.inf) < 2 * self.vouchers()[1])):
            return None
        self._own_check.add(key)
        logger.info("checking plan epoch %d signed by %s ourselves: %s", plan.epoch, plan.leader,
                    f"its checker {refusing[0]} says it refused a plan of epoch {plan.epoch}" if refusing else
                    "a checker names another plan" if verdict is False else
                    f"its checkers did not all say they train it within {waited_s:.0f} s")
        return False

    def _cost_problem(self, plan: PlanRecord, live: Mapping[str, PeerRecord], key: bytes) -> str | None:
        if key in self._costs:
            return self._costs[key]
        try:
            own = self.rows_for(plan)  # the rows our own search read, where it was this plan's
            if plan.rows:  # the versions the leader planned with: any later rows cut back to them
                rows = rows_as_planned(plan, {**(own or {}), **self.read_rows()}, self.history)
            else:
                rows = self.read_rows() if own is None else own
        except Exception as e:  # noqa: BLE001 - a failed read is retried at the next poll, not a verdict
            logger.warning("cannot read the links rows to check plan epoch %d: %s; retrying", plan.epoch, e)
            return None
        live = with_slowdowns(live, plan_slowdowns(plan))  # the leader's factors: only ever slower (``claims``)
        started = time.monotonic()
        try:
            train = at_stages(self.train, plan.stages) if self.stages.auto else self.train
            check = cost_check(plan, live, rows, train, self.plan, self.emulation, self.workload_for,
                               self.plan.verify_tolerance, self.plan.verify_slack_s,
                               self.leaders.standing.proven)
        except ValueError as e:
            self._costs[key] = str(e)
            return self._costs[key]
        finally:
            self._check_s[key] = time.monotonic() - started
        self._costs[key] = check.problem
        self._check_short[key] = check.stopped_short
        # what the check cost us is our search's time, also where it was the one we made when the plan fell due
        # (``searches._searched``): the trainers' no-show window is twice it, and peers without that search at hand
        # make it now (32 agents on two cores: 16 s was too short for them)
        self._check_s[key] = max(self._check_s[key], check.search_s)
        logger.info("plan epoch %d signed by %s checked: %.4g s per step, ours %.4g s", plan.epoch, plan.leader,
                    check.theirs_s, check.ours_s)
        return check.problem
