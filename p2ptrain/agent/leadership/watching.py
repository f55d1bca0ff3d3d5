"""A follower's watch of the leader: when a plan is due, how long the leader may take, passing it over.

    watching = Watching(config, dht, events, peer_id, leaders, view=agent_view, started=started, stages=stages,
                        planner=planner, pricing=pricing, links_wait=links_wait)
    membership = watching.watch_leader(membership)  # while another peer leads, every poll
    watching.pass_over(leader, why)                 # a leader that failed its own epoch (the agent's finding)

The leader (``leader.Leader``) owns one and hands the agent's calls to it; it runs on the thread that polls
(the agent's loop, or the step-boundary thread while an epoch trains). The first plan falls due as the leader
itself would decide (the plan trigger, then the trainers' links measured or ``links_timeout_s``: the clock of
that wait, ``LinksWait``, is the one the leader's side uses, so an agent that comes to lead goes on from it);
the leader may then take twice what our own search of the same records took (at least ``plan.time_budget_s``
where ours stopped at the check's cap), plus its publishing (a second, and twice the slowest of our own recent
DHT stores). A re-plan is due once we
are idle after an epoch; once every live trainer halted, what is left to it is its search and its publishing.
A leader that publishes no plan we accept in time is passed over
(``plan_check.LeaderWatch``), and the next-lowest peer leads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from p2ptrain.agent.churn.liveness import no_show_window_s
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership import probe_set
from p2ptrain.agent.leadership.checkers import checkers
from p2ptrain.agent.leadership.membership import Membership, plan_trigger
from p2ptrain.agent.leadership.plan_check import LeaderWatch, halts_settled, newer_plan_excuses
from p2ptrain.agent.leadership.plan_maker import (
    build_cluster,
    cluster_order,
    link_gaps,
    links_enough,
    make_plan,
    stopped_short,
    trainers_and_spares,
)
from p2ptrain.agent.leadership.pricing import PlanPricing
from p2ptrain.agent.leadership.run_stages import RunStages, at_stages, choose_run_stages
from p2ptrain.errors import ProtocolError
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.records import LinksRecord, PlanRecord
from p2ptrain.net.transport.status import MAX_SEARCH_S, Announced, PeerStatus

if TYPE_CHECKING:
    from p2ptrain.agent.leadership.leader import AgentView

logger = logging.getLogger(__name__)

PUBLISH_S = 1.0  # a leader's publishing of its plan, beyond what our own stores take lately (``_publish_s``)


class LinksWait:
    """How long the run's first plan has waited for its trainers' links to be measured: one clock, kept by the
    leader's side and the follower's alike (``reset`` once the wait is over or the plan trigger no longer
    holds)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def waited_s(self) -> float:
        """Seconds since the wait began (now, if it had not)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since

    def reset(self) -> None:
        self._since = None


class Watching:
    """A follower's watch of the leader (module docstring). ``planner`` is the leader's planner thread: our own
    search of the leader's first plan runs there, as the leader's would."""

    def __init__(self, config: AgentConfig, dht: SwarmDHT, events: EventLog, peer_id: str, leaders: LeaderWatch, *,
                 view: Callable[[], AgentView], started: float, stages: RunStages,
                 planner: concurrent.futures.Executor, pricing: PlanPricing, links_wait: LinksWait,
                 announced: Announced | None = None):
        self.config, self.dht, self.events, self.peer_id = config, dht, events, peer_id
        self._announced = announced  # what our ping answers say (``PeerStatus.search``)
        self._leaders, self._view, self._started, self._stages = leaders, view, started, stages
        self._planner, self._pricing, self._links_wait = planner, pricing, links_wait
        self._first_due = False  # the first plan fell due (``_first_plan_due``)
        self._own_search: tuple[tuple[str, ...], concurrent.futures.Future] | None = None  # ``_search_allowance``
        self._own_started = 0.0  # when our own search of the first plan began
        self._own_late = 0.0  # how late after the plan fell due it began: a member that is no checker's (below)
        self._own_rows: tuple[frozenset[str], Mapping[str, LinksRecord]] | None = None  # what that search read
        self._settled: dict[tuple[str, int], float] = {}  # (leader, epoch) -> when its re-plan's halts were all in
        self._timed_by: tuple[str, ...] | None = None  # the members whose late leader we timed by its checkers' word

    def watch_leader(self, membership: Membership) -> Membership:
        """Pass over a leader that has not published a plan we accept in time (``plan_check.LeaderWatch``);
        ``membership`` without it once passed over. The clock runs while a plan is due: the first once the
        plan trigger fired and the links are measured (as the leader itself decides); a later one from when
        we went idle after an epoch, with no newer plan published since by the leader (a peer left out of a
        newer plan waits for a re-plan point like any joiner; ``plan_check.newer_plan_excuses``)."""
        cfg = self.config
        view = self._view()
        followed = view.following.epoch if view.following is not None else -1
        if newer_plan_excuses(view.newest_seen, followed, membership.leader, membership.ids):
            self._leaders.waiting(None, False)
            return membership
        if view.following is None:
            due = self._first_plan_due(membership)
            allowance = self._search_allowance(membership) if due else cfg.plan.time_budget_s + self._publish_s()
        else:
            due, allowance = True, cfg.plan.time_budget_s + cfg.churn.halt_timeout_s + cfg.dht.peer_ttl_s
            settled = self._replan_settled(view, membership)
            if settled is not None:  # every live trainer halted: what is left is the search and the publishing
                since = self._leaders.due_since(membership.leader, time.monotonic())
                allowance = min(allowance, max(0.0, settled - since) + self._replan_search_s(view)
                                + self._judging_s(view))
        grace = self._leaders.grace_s
        leader = self._leaders.waiting(membership.leader, due, allowance)
        if leader is None:
            return membership
        self.pass_over(leader, f"no plan we accept came within {grace + allowance:.0f} s of one being due")
        return membership.without(leader)

    def pass_over(self, leader: str, why: str) -> None:
        """Leave ``leader`` out of our view of the members for its back-off (``LeaderWatch.pass_over``): the
        next-lowest peer leads. ``why``: for the log line."""
        if leader == self.peer_id or leader in self._leaders.excluded():
            return
        backoff = self._leaders.pass_over(leader)
        logger.warning("passing over the leader %s: %s; the next-lowest peer leads (it may lead again in %.0f s)",
                       leader, why, backoff)
        self.events.write("passed_over", peer=leader, backoff_s=backoff, reason=why)

    def rows_to_check(self, plan: PlanRecord) -> Mapping[str, LinksRecord] | None:
        """The links rows to check the run's first ``plan`` on: those our own search of its members read when the plan
        fell due (``_search_allowance``), about when the leader read them, not the rows at our check. A plan's
        neighbours measure each other once it is out, and a busy run's followers check it minutes later: scored on
        links the leader never saw, an honest plan was refused (32 agents, session 43). None: read them afresh (a
        re-plan, or other members)."""
        if plan.start_step != 0 or self._own_rows is None or self._own_rows[0] != frozenset(plan.membership):
            return None
        return self._own_rows[1]

    def first_trainers(self, order: list[str]) -> list[str]:
        """The peers the run's first plan makes trainers, whose links must be measured before it is made: with
        ``stages = "auto"``, until the stage count is chosen, every member (any of them may train)."""
        stages = self._stages.next_plan(None)
        return list(order) if stages is None else trainers_and_spares(order, self.config.train, stages)[0]

    def _first_plan_due(self, membership: Membership) -> bool:
        """Whether the run's first plan is due (a follower's view of the leader's own decision). Once due it
        stays due while the trigger holds: rows read later may show gaps again (a DHT read that misses a
        record; followers that passed a leader over measure it no more), and a gap must not restart the
        clock on a leader that has not planned; that once held a lagging follower two minutes on a silent
        leader (``links_timeout_s``) while the others trained without it."""
        cfg = self.config
        waited = time.monotonic() - self._started
        if plan_trigger(self._view().seen, cfg.membership, waited) is None:
            self._links_wait.reset()
            self._first_due = False
            return False
        if self._first_due:
            return True
        try:
            trainers, graph = self.first_trainers(cluster_order(membership.peers)), probe_set.graph(membership.peers, cfg)
            gaps = link_gaps(trainers, self.dht.read_links(), graph)
        except (ValueError, ProtocolError):
            return False
        waited_s = self._links_wait.waited_s()
        self._first_due = (links_enough(gaps, trainers, graph, cfg.membership.links_missing)
                           or waited_s >= cfg.membership.links_timeout_s)
        return self._first_due

    def _replan_settled(self, view: AgentView, membership: Membership) -> float | None:
        """When we first saw every live trainer of the epoch we followed halted (or done), with nothing left for
        its leader to judge (no bulk evidence) and members enough for the run's plan: from then on
        the leader's re-plan is its search and its publishing alone (``replan.ReplanWatch`` waits for nothing
        more). None while that is not so: the leader may wait for halts (``churn.halt_timeout_s``), evidence
        (``verify.evidence_timeout_s``) or peers, and gets the whole allowance."""
        plan = view.following
        settled = halts_settled(plan, membership.ids, view.progress, self.config.train.steps)
        if settled:
            try:
                trainers_and_spares(cluster_order(membership.peers), at_stages(self.config.train, plan.stages))
            except ValueError:
                settled = False  # too few members for a plan: the leader waits for peers, as we would
        key = (plan.leader, plan.epoch)
        if not settled:
            self._settled.pop(key, None)
            return None
        return self._settled.setdefault(key, time.monotonic())

    def _judging_s(self, view: AgentView) -> float:
        """What a re-plan may take beyond its search when we saw a trainer stay away from the epoch (or one's
        time still ran): the leader judges it on its own heartbeats first (``leader.Leader``: "judging whether
        … took it up"), a verdict that comes within about the no-show window we judged by, counted from its own
        start of the epoch (``liveness.no_show_window_s``), and a heartbeat interval."""
        if not (view.no_shows or view.unjudged):
            return 0.0
        cfg = self.config
        window_s = no_show_window_s(cfg.liveness.interval_s, self._leaders.grace_s, cfg.membership.poll_s, math.inf)
        return window_s + cfg.liveness.interval_s

    def _replan_search_s(self, view: AgentView) -> float:
        """What a re-plan's search and publishing may take: twice our own search of the run's plans (the first
        plan's, or our check of the one followed), at least ``plan.time_budget_s`` where ours reached the check's
        cap, then the publishing (``search_allowance``)."""
        budget_s, own = self.config.plan.time_budget_s, 0.0
        if self._own_search is not None and self._own_search[1].done() and self._own_search[1].exception() is None:
            own = self._own_allowance(self._own_search[1].result())
        return max(own, search_allowance(view.check_s, view.check_short, budget_s, self._publish_s()))

    def _search_allowance(self, membership: Membership) -> float:
        """What the leader may spend on its search, beyond the grace, for the first plan of ``membership``:
        twice what our own search of the same records took, plus the publishing (``_publish_s``). Our search runs
        once per membership, from the planner thread the leader would use, in the check thread (heartbeats and
        polling go on); where it cannot run, the whole ``plan.time_budget_s`` and the publishing; while it runs, at
        least that and twice what it has taken so far: the leader's search is the same one (``make_plan``), and
        ours, below its agent in priority, is the slower (32 agents on two cores: a leader whose search outlasted
        the budget was passed over while its followers' searches still ran). A silent leader is thus passed over
        seconds after the plan fell due, not a minute: the search on a small run takes milliseconds. A member that
        is not among the plan's checkers (``checkers``) makes no search: the budget and the publishing; once the
        leader is later than the budget, twice what its checkers say their searches have run or took
        (``checkers_search_s``; 32 agents on two cores: members that searched nothing passed over a leader whose
        search of 32 devices, bounded by its evaluations, took longer than the budget), and where none of them says,
        its own search after all, giving the leader the budget and twice that search's time so far while it runs.
        Our own search's time is said in our ping answers (``PeerStatus.search``)."""
        cfg = self.config
        key = membership.ids
        fresh = self._own_search is None or self._own_search[0] != key
        chosen = checkers(key, membership.leader, cfg.run, cfg.plan.checkers)
        if fresh and self.peer_id not in chosen:
            now = time.monotonic()
            if now - self._leaders.due_since(membership.leader, now) < cfg.plan.time_budget_s:
                return cfg.plan.time_budget_s + self._publish_s()  # its checkers search; we follow on their word
            said = checkers_search_s(self._view().statuses, chosen)
            if said is not None:  # the leader is late: as long as its checkers' searches take, none of our own
                if self._timed_by != key:
                    self._timed_by = key
                    logger.info("the leader %s is late with the first plan: giving it twice what its checkers say "
                                "their searches take (%.0f s so far), without a search of ours", membership.leader, said)
                return max(cfg.plan.time_budget_s, 2.0 * said) + self._publish_s()
            self._own_late = cfg.plan.time_budget_s  # nobody says: our own search times it from now on
        elif fresh:
            self._own_late = 0.0
        if fresh:
            self._own_started = time.monotonic()
            stages = self._stages.next_plan(None)
            try:
                rows = self.dht.read_links()
                self._own_rows = (frozenset(key), rows)
                if stages is None:  # stages = "auto": the leader chooses the stage count first, as we do here
                    self._own_search = (key, self._planner.submit(self._own_first_plan, membership, rows))
                else:
                    train = at_stages(cfg.train, stages)
                    trainers, _ = trainers_and_spares(cluster_order(membership.peers), train)
                    cluster = build_cluster(trainers, membership.peers, rows, cfg.emulation)
                    workload = self._pricing.plan_workload(trainers, membership, train)
                    self._own_search = (key, self._planner.submit(make_plan, cluster, workload, stages, cfg.plan,
                                                                  check=True))
            except (ValueError, ProtocolError):
                return cfg.plan.time_budget_s + self._publish_s()
        future = self._own_search[1]
        if not future.done():  # the leader's search is ours: never faulted while ours still runs
            elapsed_s = time.monotonic() - self._own_started
            self._say_search(elapsed_s)
            return max(cfg.plan.time_budget_s, self._own_late + 2.0 * elapsed_s) + self._publish_s()
        if future.exception() is not None:
            return cfg.plan.time_budget_s + self._publish_s()
        self._say_search(float((future.result().get("search") or {}).get("seconds") or 0.0))
        return self._own_allowance(future.result())

    def _say_search(self, seconds: float) -> None:
        """Our ping answers say how long our search of the first plan has run, or took (``PeerStatus.search``)."""
        if self._announced is not None:
            self._announced.search = min(MAX_SEARCH_S, math.ceil(seconds))

    def _own_allowance(self, plan: dict[str, Any]) -> float:
        """``search_allowance`` from our own search of the first plan (``plan``, its document)."""
        search = plan.get("search") or {}
        devices = sum(len(row) for row in plan.get("pipelines") or ())
        return search_allowance(float(search.get("seconds") or 0.0), stopped_short(search, self.config.plan, devices),
                                self.config.plan.time_budget_s, self._publish_s())

    def _publish_s(self) -> float:
        """What the leader's publishing may take: a second, and twice the slowest of our own last DHT stores (a
        plan's parts, then its head). 32 agents on two cores: a leader whose search ran its whole 60 s budget
        stored its plan 18 s later, after its followers' allowance had run out, and was passed over."""
        return PUBLISH_S + 2.0 * self.dht.slowest_store_s()

    def _own_first_plan(self, membership: Membership, rows) -> dict[str, Any]:
        """Run in the planner thread: the stage count chosen for ``membership`` and the plan at it, as the leader
        of an auto run's first plan makes them; the ``seconds`` of its ``search`` are the whole time both took."""
        cfg, started = self.config, time.perf_counter()
        order = cluster_order(membership.peers)
        choice = choose_run_stages(order, membership.peers, rows, cfg.train, cfg.plan, **self._pricing.measured_costs(membership))
        best = choice.best
        if best is None:
            raise ValueError("no stage count fits the devices' memory")
        train = at_stages(cfg.train, best.num_stages)
        trainers, _ = trainers_and_spares(order, train)
        cluster = build_cluster(trainers, membership.peers, rows, cfg.emulation)
        plan = make_plan(cluster, self._pricing.plan_workload(trainers, membership, train), best.num_stages, cfg.plan)
        return {**plan, "search": {"seconds": time.perf_counter() - started}}


def checkers_search_s(statuses: Mapping[str, PeerStatus], chosen: Collection[str]) -> float | None:
    """How long the plan's checkers (``chosen``) say, in their ping answers, their own searches of the first plan
    have run or took (``PeerStatus.search``): the lower median of those that say it (one checker that claims a
    day cannot hold the run on a silent leader), None where none does."""
    said = [status.search for peer, status in statuses.items() if peer in chosen and status.search >= 0]
    return float(statistics.median_low(said)) if said else None


def search_allowance(seconds: float, short: bool, budget_s: float, publish_s: float = PUBLISH_S) -> float:
    """What a leader's search and publishing may take, from our own search of the same records (``seconds``):
    twice it (the leader makes the same search first, bounded by its evaluations, not by time:
    ``plan_maker.make_plan``), at least ``budget_s`` where ours stopped ``short`` at the check's cap
    (``plan_maker.stopped_short``: the leader's full search goes on in what is left of the budget), and
    ``publish_s`` to publish the plan. 64 agents on two cores: our search of 64 devices took 5.3 minutes, the
    leader's 6, and a cap at the 60 s budget passed it over the moment ours ended."""
    return (max(budget_s, 2.0 * seconds) if short else 2.0 * seconds) + publish_s
