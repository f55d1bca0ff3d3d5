"""The agent: join a run, profile, measure links, elect, plan (the leader), follow the plan, train.

    with StopSignal() as stop:
        result = Agent(config, stop).run()

States, driven by one loop in the calling (main) thread, every ``membership.poll_s``:

1. **join**: profile the device (cached), start the DHT peer and the transport on its daemon (one peer ID
   for records and tensors), publish our signed peer record (profile, addresses, emulated device).
2. **measure**: each poll reads the peer records (membership), dials new peers by address, shapes the
   links to them when emulating, and hands the settled ones to the link prober (a background thread that
   publishes our links row).
3. **elect**: the lowest live peer ID leads (the leader's state machine and its state:
   ``leadership.leader.Leader``, which the loop hands each poll while this agent leads). The leader plans once
   ``plan_trigger`` says so (expected peers present, or the join deadline passed) and every trainer's row
   covers the others (or ``links_timeout_s`` passed): it builds the cluster from the records, runs the
   planner in a worker thread (heartbeats and polling go on meanwhile), and publishes the plan record for
   the next epoch. The others pass over a leader that publishes no plan they accept in time.
4. **follow**: everyone (the leader too) reads the plan records and follows the highest epoch signed by
   the peer it sees as lowest that names it as a member (``election.latest_plan``; epochs decide, so a
   leader that comes back late cannot split the swarm), then trains that epoch (``epoch.run_epoch``).
5. **churn**: at every step boundary an epoch asks ``_should_halt``, whose answer a thread of its own keeps
   current by polling and leading as the idle loop does (``churn.boundary``: no DHT read on the training
   thread). A failed call halts the epoch (a heartbeat says which steps of its stage the agent keeps); the
   leader — the lowest live peer, so the next one when a leader dies — waits for every live trainer to
   halt and publishes the next epoch from the highest step every stage still has (``replan.ReplanWatch``,
   ``restart.restart_point``: a surviving replica's kept state, else the last checkpoint). Joiners wait
   until the next re-plan point, then the trainers stop at the plan's start step and hand over their
   stages' states. Checkpoints (``[checkpoint]``) are written by replica 0 of each stage every K steps.
6. **liveness and warm copies**: a heartbeat thread (``liveness.LivenessMonitor``) pings the members; a dead
   trainer, or one that failed its epoch, aborts our epoch's pending calls at once (``epoch_watch``), and dead peers leave
   our view of the live members until they answer again. Every plan names a backup peer per stage that
   keeps a warm copy of it (``churn.warm_copies``); every agent keeps its copies on its own disk (``state_store``),
   which ``checkpoint.resume`` restarts a whole swarm from.

SIGTERM/SIGINT (the ``StopSignal``) interrupt any state: a blocked step is cut short by shutting the
transport down, and the DHT process and p2pd are stopped in order, so nothing is left running.

Threads and the fields they share. The *poller* is the main thread while no epoch trains and the step-boundary
thread (``churn.boundary.BoundaryWatch``) while one does: the boundary thread is started after the main thread's
last poll and stopped before its next, so the poller's fields (the membership, the plans read, the standing,
the leader's side) have one writer at a time. The others:

| field | written by | read by |
|---|---|---|
| ``_following`` | main (``_follow``: one reference, set before the epoch starts) | liveness, poller |
| ``_done_now``, ``_went_on`` | main (``_should_halt`` at a step boundary, ``_follow``) | poller |
| ``_poll_s`` (a deque) | main (``_should_halt``) | poller (the leader's pricing copies it whole) |
| ``_peer_record`` | main (before the prober starts), prober (``_on_access``) | prober |
| ``_epochs`` (``epoch_watch.EpochWatch``) | main, liveness, poller: under its own lock | all three |
| ``_run`` (``leadership.following.Following``: the plans and progress read) | poller; ``followed``, ``halted_epoch``: main | poller, main |
| ``_membership``, ``_seen`` | poller (``_poll``, ``Following.pass_over``, the leader's watch) | poller, main |
| ``transport.status`` | main (``_follow``), poller (``_taking_up``) | the transport's heartbeat answers |
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.agent.churn.boundary import INTERVAL_S, BoundaryWatch, overshot
from p2ptrain.agent.churn.liveness import (
    NO_SHOW_TIMEOUTS,
    LivenessMonitor,
    no_show_window_s,
)
from p2ptrain.agent.churn.stage_state import StateKeeper
from p2ptrain.agent.churn.state_store import StateStore
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.epoch import EpochContext, EpochOutcome, Heartbeat, freeze_heap, run_epoch
from p2ptrain.agent.epoch_watch import EpochWatch
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership import settings
from p2ptrain.agent.leadership.disputes import EvidenceInbox
from p2ptrain.agent.leadership.following import Following
from p2ptrain.agent.leadership.leader import AgentView, Leader
from p2ptrain.agent.leadership.membership import Membership, MembershipTracker
from p2ptrain.agent.leadership.plan_check import LeaderWatch, PlanGate, trainers_of
from p2ptrain.agent.leadership.plan_wait import PlanWait
from p2ptrain.agent.leadership.run_stages import RunStages, stages_on_disk
from p2ptrain.agent.links import LinkProber
from p2ptrain.agent.membership_reader import MembershipReader
from p2ptrain.agent.profile import profile_device
from p2ptrain.agent.senders import min_rates, sender_budgets
from p2ptrain.agent.shaping import LinkShaping
from p2ptrain.agent.tag_senders import TagSenders
from p2ptrain.errors import AgentError, ProtocolError
from p2ptrain.lifecycle import StopSignal, shutdown_in_order
from p2ptrain.model.compiled import check_compile
from p2ptrain.model.data import data_identity
from p2ptrain.net.counters import traffic_per_minute
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.records import ComputeMeasurement, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.dht.retry import retrying
from p2ptrain.net.nat.forward import setup_forwarding
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.status import IDLE, TRAIN, PeerStatus
from p2ptrain.runtime.calibration import calibrate, expected_rows
from p2ptrain.runtime.compute_speed import compute_slowdown
from p2ptrain.runtime.reference import resolve_device, torch_settings
from p2ptrain.runtime.throughput import peak_tflops

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class AgentResult:
    peer_id: str
    finished: bool  # every step was trained (or, for a spare, the trainers finished)
    steps_done: int
    stopped: str | None = None  # why it stopped early (a signal), None if it finished


class Agent:
    _leading_class: type[Leader] = Leader  # tests lead badly by subclassing it (``tests/agent/rogue_leader.py``)

    def __init__(self, config: AgentConfig, stop: StopSignal):
        self.config = config
        self.stop = stop
        self.events = EventLog(config.events_file)
        self.dht: SwarmDHT | None = None
        self.transport: Transport | None = None
        self.prober: LinkProber | None = None
        self._peer_record: PeerRecord | None = None  # as last published (a measured access link replaces it)
        self._shaping = LinkShaping(config)  # the emulated network's links, and the access line published
        self.emulator, self.network = self._shaping.emulator, self._shaping.network
        # playing a device of a mixed cluster: compute as many times slower as its card is than the fastest
        # (and the whole emulated world compute_scale times slower still)
        self.compute_slowdown = (compute_slowdown(self.network, config.emulation.device_index,
                                                  config.emulation.compute_scale)
                                 if self.network is not None else 1.0)
        self.data_id = data_identity(config.train.data)  # in our peer record: the run's agents must agree
        self.stages = RunStages(config.train)  # the run's S: the config's, or (auto) pinned once known
        self._leading: Leader | None = None  # the leader's side (``leadership.leader``), from the loop's start
        self._peak: tuple[float | None, str] = (None, "unknown")  # this device's peak TFLOP/s (MFU), and its source
        self._following: PlanRecord | None = None  # the last plan this agent followed
        self._inbox: EvidenceInbox | None = None  # bulk evidence for this agent as leader (from ``_loop``)
        self._run: Following | None = None  # what the run's records say to the poller (from ``_loop``)
        self._tracker: MembershipTracker | None = None
        self._reader: MembershipReader | None = None  # the poll's read of who is live (from the loop's start)
        self._membership = Membership({})
        self._seen = Membership({})  # the live view before passed-over leaders are left out
        self._leaders = LeaderWatch(config.membership.leader_grace_s, config.membership.leader_backoff_s,
                                    poll_s=config.membership.poll_s)
        self._gate: PlanGate | None = None
        self._last_poll = 0.0
        self._started = time.monotonic()
        self._done_now: int | None = None  # steps done in the epoch being trained
        self._went_on: int | None = None  # steps done at the last boundary that went on to the next step
        self._boundary: BoundaryWatch[PlanRecord] | None = None  # the step-boundary check while an epoch trains
        # with the recompute check one more: a step is checked in the next one's shadow (``verify.recompute_check``)
        self.keeper = StateKeeper(config.churn.keep_states + int(config.verify.enabled))
        self.store: StateStore | None = None
        self.liveness: LivenessMonitor | None = None
        self._epochs: EpochWatch | None = None  # the heartbeats' watch of the epoch followed (from the join)
        self._last_wait_note = ""
        self._finished = threading.Event()
        self.heartbeat: Heartbeat | None = None
        self._poll_s: collections.deque[float] = collections.deque(maxlen=64)  # a step boundary's cost to training

    # ---- lifetime ---------------------------------------------------------------------------------------

    def run(self) -> AgentResult:
        cfg = self.config
        device = resolve_device(cfg.train.device)
        if cfg.train.compile:
            check_compile(device)  # a ConfigError in one line before the agent joins the run
        with torch_settings(cfg.train.num_threads, cfg.train.deterministic):
            freeze_heap()  # the libraries, imported by now
            profile = profile_device(device, cache_dir=_path(cfg.profile.cache_dir), refresh=cfg.profile.refresh,
                                     measure_s=cfg.profile.measure_s)
            self.events.write("profile", device_name=profile.device_name, tflops=profile.tflops,
                              memory_gb=profile.memory_gb, cached=profile.cached)
            self._peak = peak_tflops(profile.device_name, cfg.train.precision, profile.tflops)  # MFU's
            compute = self._calibrate(device)
            if self.stop.is_set():
                return AgentResult("", False, 0, self.stop.reason)
            watcher = threading.Thread(target=self._interrupt_on_stop, name="p2ptrain-stop-watch", daemon=True)
            watcher.start()
            try:
                self.dht = SwarmDHT.join(cfg.run, cfg.dht, stopped=self.stop.is_set)
                self.transport = Transport(cfg.run, cfg.transport, dht=self.dht.hivemind_dht, emulator=self.emulator)
                routes = self.transport.run_coroutine(setup_forwarding(
                    self.transport.p2p, cfg.dht.relay, cfg.dht.initial_peers, cfg.transport.call_timeout_s),
                    cfg.dht.startup_timeout_s)
                self.dht.peer_listeners.append(routes.update)  # peers behind NAT: tensors go through a relay
                self.transport.mailbox.admit_sender = self.dht.is_admitted  # closed runs: tensors from members only
                self.transport.mailbox.senders = {}  # nobody sends tensors before we know the run (``_admit_senders``)
                self._epochs = EpochWatch(self.peer_id, cfg.liveness, self.transport.abort_epoch)
                self.store = StateStore(self.keeper, self._local_dir(), cfg.train.model, cfg.train.seed,
                                        shape=cfg.train.shape)
                if cfg.checkpoint.resume:
                    self._offer_saved_states()
                if cfg.liveness.enabled:
                    self.liveness = LivenessMonitor(self.transport, cfg.liveness, on_round=self._on_heartbeats).start()
                self._publish_peer_record(profile, compute)
                self.prober = LinkProber(self.transport, self.dht, cfg.links, on_publish=self._on_links, on_access=self._on_access)
                self.prober.measure_access = self._shaping.measures_access()
                self.prober.start()
                self.heartbeat = Heartbeat(self.dht, lambda: traffic_per_minute(self.dht.counters, self.transport.counters))
                return self._loop(device)
            except Exception as e:
                self.events.write("error", error=f"{type(e).__name__}: {e}")
                raise
            finally:
                self._finished.set()
                watcher.join()
                self._shutdown()

    def _interrupt_on_stop(self) -> None:
        """On SIGTERM/SIGINT, cut a blocked step short: fail pending sends and receives."""
        while not self._finished.is_set():
            if self.stop.wait(0.2):
                for thread in (self.liveness, self.prober):  # they would ping and probe a shut transport
                    if thread is not None:
                        thread.stop(timeout_s=0)
                if self.transport is not None:
                    self.transport.shutdown()
                return

    def _shutdown(self) -> None:
        timeout_s = self.config.transport.shutdown_timeout_s
        # The prober is told to stop first and joined once the transport is down: a probe in flight to a peer
        # that already left would otherwise hold the exit for the whole join timeout; the transport's
        # shutdown fails that call, and a stopped prober ends quietly on it.
        shutdown_in_order([
            ("stop heartbeat pings", lambda: self.liveness and self.liveness.stop(timeout_s)),
            ("finish writing state copies", lambda: self.store and self.store.close(timeout_s)),
            ("tell the link prober to stop", lambda: self.prober and self.prober.stop(timeout_s=0)),
            ("stop the planner", lambda: self._leading and self._leading.close()),
            ("stop the standing reader", lambda: self._run and self._run.close()),
            ("stop heartbeats", lambda: self.heartbeat and self.heartbeat.close()),
            ("stop the transport", lambda: self.transport and self.transport.shutdown()),
            ("stop the link prober", lambda: self.prober and self.prober.stop(timeout_s)),
            ("stop the DHT peer", lambda: self.dht and self.dht.shutdown()),
        ])

    @property
    def peer_id(self) -> str:
        assert self.dht is not None
        return self.dht.peer_id

    def _local_dir(self) -> Path | None:
        """Where this agent keeps its own state copies (``[checkpoint] local_dir``; "" for nowhere)."""
        local = self.config.checkpoint.local_dir
        if local == "":
            return None
        if local is not None:
            return Path(local)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "p2ptrain" / "state" / self.config.run / self.peer_id

    def _offer_saved_states(self) -> None:
        """``--resume``: say which stage states our own disk holds, before the leader plans (peer record
        after this), so that the first plan restarts from them."""
        stages = self.stages.pinned
        if stages is None and self.store.disk_dir is not None:  # stages = "auto": our copies' S is the run's
            stages = stages_on_disk(self.store.disk_dir, self.config.train, complete=False)
            if stages is not None:
                self.stages.pin(stages, "this agent's own copies on disk")
        found = self.store.scan_disk(stages) if stages is not None else []
        logger.info("resume: %d verified state copies on this agent's disk%s", len(found),
                    f" (newest step {max(s for _, s in found)})" if found else "")
        record = ProgressRecord(0, 0, None, 0.0, halted=True, holds=tuple(found[-32:]))
        retrying("storing the copies this agent holds", lambda: self.dht.publish_progress(record),
                 self.config.dht.start_retry_s, self.stop.wait)

    def _on_heartbeats(self) -> None:
        """After every heartbeat round (the liveness thread): ``EpochWatch.on_round`` on the epoch followed."""
        self._epochs.on_round(self._following, self.liveness)

    def _calibrate(self, device) -> ComputeMeasurement | None:
        """For the simulated objective: time the run's model on this device (``runtime.calibration``)."""
        cfg = self.config
        if cfg.plan.objective != "simulated":
            return None
        rows = expected_rows(cfg.train, cfg.membership.expect or cfg.membership.min_peers)
        compute = calibrate(cfg.train, rows, device, compute_slowdown=self.compute_slowdown)
        self.events.write("calibration", **compute.to_wire())
        return compute

    def _publish_peer_record(self, profile, compute: ComputeMeasurement | None = None) -> None:
        emulation = self.config.emulation
        region = self.config.region
        if self.network is not None:
            region = self.network.devices[emulation.device_index].region or region
        record = PeerRecord(
            device_name=profile.device_name, memory_gb=profile.memory_gb, tflops=profile.tflops,
            maddrs=tuple(self.dht.get_visible_maddrs()[:16]), region=region,
            emulated_device=emulation.device_index, compute=compute, data=self.data_id,
            settings=settings.identity(self.config.train, self.config.verify), **self._shaping.line(self.prober.access if self.prober is not None else {}),
        )
        retrying("storing our peer record", lambda: self.dht.publish_peer(record), self.config.dht.start_retry_s,
                 self.stop.wait)  # a busy DHT at a crowd's start: tried again, not the agent's end
        self._peer_record = record
        logger.info("joined run %r as peer %s%s", self.config.run, self.peer_id,
                    f" (playing device {emulation.device_index}, {region})" if self.network is not None else "")
        self.events.write("started", peer=self.peer_id, maddrs=list(record.maddrs), region=region,
                          index=emulation.device_index)

    # ---- the loop ---------------------------------------------------------------------------------------

    def _loop(self, device) -> AgentResult:
        cfg = self.config
        self._tracker = MembershipTracker(self.peer_id, data=self.data_id, settings=settings.identity(cfg.train, cfg.verify))
        self._reader = MembershipReader(cfg, self.peer_id, self._tracker, self.dht, self.transport, self.prober,
                                        self.liveness, self._leaders, self._shaping, self.events)
        self._run = run = Following(self)
        self._gate = _plan_gate(self, run)
        self._started = time.monotonic()
        self._plan_wait = PlanWait(self._started)  # the first plan's wait since the run last moved toward one
        self._inbox = EvidenceInbox(self.peer_id, self.transport, self.dht.keys.run_id)
        self._leading = self._leading_class(cfg, self.dht, self.events, self.peer_id, self._leaders, view=self._view,
                                            note_waiting=self._note_waiting, boundary_s=self._poll_s,
                                            started=self._started, stages=self.stages,
                                            fetch_evidence=self._inbox.fetch,
                                            announced=self.transport.announced)
        while not self.stop.is_set():
            self._poll()
            plan = run.next_plan()
            if plan is not None:
                outcome = self._follow(plan, device)
                if outcome.finished:
                    held = self.keeper.latest_step == outcome.steps_done and outcome.steps_done > 0
                    self.events.write("done", epoch=plan.epoch, steps=outcome.steps_done,
                                      stage=self.keeper.stage if held else None,
                                      params_sha256=self.keeper.digest() if held else None)
                    logger.info("done: %d steps trained (last epoch %d)", outcome.steps_done, plan.epoch)
                    return AgentResult(self.peer_id, True, outcome.steps_done)
                if self.stop.is_set():
                    break
                continue
            if (finished := run.finished_without_me()) is not None:
                logger.info("the run finished without this agent (not a member of the last plan, epoch %d by %s)",
                            finished.epoch, finished.leader)
                self.events.write("done", epoch=finished.epoch, steps=0, stage=None, params_sha256=None)
                return AgentResult(self.peer_id, True, 0)
            idle_s = time.monotonic() - run.run_moved_at
            if self._following is not None and idle_s > cfg.membership.idle_timeout_s:
                raise AgentError(f"the run made no progress this agent can see for {idle_s:.0f} s while it trained "
                                 f"nothing (idle_timeout_s={cfg.membership.idle_timeout_s:.0f}); it stops here, and "
                                 "a restarted agent joins the run again")
            membership = self._membership
            if membership.leader == self.peer_id:
                self._leading.lead(membership)
            else:
                self._note_waiting(f"waiting for a plan from the leader {membership.leader} ({len(membership)} peers live)")
                self._membership = self._leading.watch_leader(membership)
            waited_s = self._plan_wait.observe(membership.ids, self._view().statuses, self.transport.announced.search,
                                               run.max_epoch_seen, self._leading.planning)
            if self._following is None and waited_s > cfg.membership.plan_timeout_s:
                raise AgentError(
                    f"no plan for the live membership ({len(membership)} peers, leader {membership.leader}) within "
                    f"plan_timeout_s={cfg.membership.plan_timeout_s:.0f} of the run's last move toward one "
                    f"({self._plan_wait.why}); check the leader's log")
            self.stop.wait(cfg.membership.poll_s)
        logger.info("stopping (%s)", self.stop.reason)
        self.events.write("stopped", reason=self.stop.reason)
        return AgentResult(self.peer_id, False, 0, self.stop.reason)

    def _poll(self, force: bool = False) -> None:
        read = self._reader.read(self._following, force)
        if read is not None:
            self._seen, self._membership = read
            self._admit_senders(self._membership)
        self._last_poll = time.monotonic()

    def _should_halt(self, done: int | None) -> bool:
        """At a step boundary of an epoch (``done``: steps done; None for a spare): poll and lead as the idle
        loop does (every ``poll_s``), and say whether a newer plan takes over from here. While an epoch runs the
        polling is done off the training thread (``churn.boundary``): this reads its latest answer."""
        started = time.perf_counter()
        self._done_now = done
        following = self._following
        if done is not None and following is not None and done > following.start_step:  # states of its S exist now
            self.stages.pin(following.stages, f"epoch {following.epoch}, the first plan this agent trained")
        plan = self._boundary.plan if self._boundary is not None else self._boundary_check()
        if done is not None:  # what a boundary costs the training thread (the simulated objective adds it)
            self._poll_s.append(time.perf_counter() - started)
        if plan is None and done is None:  # a spare left out of a newer plan stops waiting on the old one's end
            newest, following = self._run.newest_seen, self._following
            return (newest is not None and following is not None and newest.epoch > following.epoch
                    and self.peer_id not in newest.membership)
        halt = plan is not None and (done is None or plan.start_step <= done)
        self._went_on = None if halt else done  # the step after ``done`` is in flight (``_boundary_check``)
        return halt

    def _boundary_check(self) -> PlanRecord | None:
        """Poll and lead as the idle loop does (every ``poll_s``); the plan to follow next, or None."""
        if time.monotonic() - self._last_poll >= self.config.membership.poll_s:
            self._poll()
            if self._membership.leader == self.peer_id:
                self._leading.lead(self._membership)
        plan = self._run.next_plan()
        training, done = self._epochs.training, self._went_on
        if plan is not None and training is not None and overshot(plan.start_step, training, plan.epoch, done) and \
                self._epochs.abort_first(training, f"a newer plan (epoch {plan.epoch}) starts after step "
                                                   f"{plan.start_step}", failure=False):
            logger.info("epoch %d: the plan of epoch %d starts after step %d, which this agent passed before it saw "
                        "the plan; cutting the step in flight short", training, plan.epoch, plan.start_step)
        return plan

    def _admit_senders(self, membership: Membership, *plans: PlanRecord) -> None:
        """Who may send us tensors, and how much each may hold (``agent.senders``): the members of the plans
        we train or may train next, then other live peers; nobody else. Which tag each sends: ``agent.tag_senders``."""
        candidates = (self._following, self._run.newest_seen, *plans)
        mailbox = self.transport.mailbox
        mailbox.sends_tag = TagSenders.of(self.peer_id, candidates)  # and each tag only from the peer sending it
        mailbox.senders = sender_budgets(candidates, membership.ids, self.peer_id, self.config.train,
                                         self.config.transport.step_window)

    def _on_access(self, measured: dict) -> None:
        """The prober measured our line anew (``measured``, also its ``access``): publish it in our peer record
        where nothing declared wins."""
        record = self._peer_record
        line = self._shaping.line(self.prober.access if self.prober is not None else {})
        if record is None or line == {k: getattr(record, k) for k in line}:
            return
        record = dataclasses.replace(record, **line)
        try:
            self.dht.publish_peer(record)
        except ProtocolError as e:
            logger.warning("publishing our measured access link failed: %s; it goes out with the next change", e)
            return
        self._peer_record = record
        self.events.write("access", **line)

    def _on_links(self, row) -> None:
        try:  # the other ends' own rows: the direction their messages to us travel
            rows = self.dht.read_links()
        except ProtocolError:
            rows = {}
        toward_us = {p: m for p, r in rows.items() if (m := r.resolve([self.peer_id]).get(self.peer_id))}
        self.transport.mailbox.min_rates = min_rates(row, toward_us)
        self.events.write("links", **_links_event(row, self.prober.version))

    def _view(self) -> AgentView:
        """What the leader's side reads of this agent (``leading.AgentView``), as it is now."""
        statuses = self.liveness.statuses() if self.liveness is not None else {}
        following = self._following
        check = self._gate.check_of(following) if following is not None and self._gate is not None else (0.0, False)
        no_shows_, unjudged = self._epochs.seen(following.epoch) if following is not None else ((), ())
        run = self._run
        return AgentView(self._seen, following, run.newest_seen, self._done_now, run.max_epoch_seen, statuses,
                         run.progress_seen, *check, no_shows_, unjudged)

    def _note_waiting(self, note: str) -> None:
        if note != self._last_wait_note:
            self._last_wait_note = note
            logger.info("%s", note)

    # ---- following --------------------------------------------------------------------------------------

    def _follow(self, plan: PlanRecord, device) -> EpochOutcome:
        cfg = self.config
        self._following = plan
        # what heartbeats answer from now on (``run_epoch`` says it again): before any setup that may wait
        self.transport.status = PeerStatus(TRAIN if self.peer_id in trainers_of(plan) else IDLE, plan.epoch,
                                           plan.start_step)
        if plan.start_step > 0:  # it restarts from states of its stage count: that is the run's
            self.stages.pin(plan.stages, f"epoch {plan.epoch}, which restarts from step {plan.start_step}'s states")
        self._run.follow(plan)
        self._admit_senders(self._membership, plan)
        self._done_now = self._went_on = None
        self.prober.pause(timeout_s=min(cfg.links.probe.deadline_s, cfg.links.pause_wait_s))  # nor queue behind a probe
        # Heartbeats notice failures; the data deadline only has to allow the plan's slowest step.
        scale = cfg.emulation.time_scale if cfg.emulation.enabled else 1.0
        call_timeout_s = max(cfg.transport.call_timeout_s, cfg.liveness.deadline_multiple * plan.cost_s * scale)
        # A trainer may take the epoch up this long after us (``liveness.no_shows``): two liveness timeouts, and
        # twice the search the plan cost us and the reads of its checkers' word (``PlanGate.lag_s``)
        effort_s = self._gate.lag_s(plan, self._leading.published_search_s if plan.leader == self.peer_id else None)
        taking_after_s = NO_SHOW_TIMEOUTS * cfg.liveness.timeout_s + 2.0 * effort_s
        train = cfg.train  # the run's settings are pinned: the gate refused plans that depart from them
        context = EpochContext(
            me=self.peer_id, train=train, device=device, transport=self.transport, dht=self.dht,
            stop=self.stop, events=self.events, heartbeat=self.heartbeat, keeper=self.keeper, store=self.store,
            checkpoint=cfg.checkpoint, call_timeout_s=call_timeout_s, taking_after_s=taking_after_s,
            state_timeout_s=call_timeout_s + cfg.churn.halt_timeout_s, poll_s=cfg.membership.poll_s,
            finish_timeout_s=cfg.membership.finish_timeout_s, should_halt=self._should_halt,
            compute_slowdown=self.compute_slowdown, link_bandwidth=self._measured_bandwidth(), time_scale=scale,
            verify=cfg.verify, on_evidence=self._inbox.keep, peak=self._peak,
        )
        self._epochs.begin(plan, taking_after_s, no_show_window_s(cfg.liveness.interval_s, self._leaders.grace_s,
                                                                  cfg.membership.poll_s, taking_after_s))
        peers = dict(self._membership.peers)
        self._boundary = BoundaryWatch(self._boundary_check, min(cfg.membership.poll_s, INTERVAL_S)).start()
        try:
            outcome = run_epoch(plan, context, peers)
            if outcome.halted:
                self._run.halted_epoch = plan.epoch
            return outcome
        except Exception:
            if self.stop.is_set():  # the stop watcher shut the transport down under a running step
                return EpochOutcome(False, 0)
            raise
        finally:
            self._run.run_moved_at = time.monotonic()  # the idle clock starts when our epoch ends
            self._boundary.stop()  # the agent's loop polls again from here, alone
            self._boundary = None
            self._epochs.end()
            self._done_now = self._went_on = None
            if not self.stop.is_set():
                self.prober.resume()


    def _measured_bandwidth(self) -> Callable[[str], float | None]:
        """Bytes per second we measured to each peer (the prober's row as this epoch starts), for sizing the
        parts of warm copies (``churn.warm_copies``)."""
        row = self.prober.row()
        return lambda peer: row[peer].bandwidth_gbps * 1e9 / 8 if peer in row else None


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def _links_event(row, version: int) -> dict:
    """The ``links`` event's fields: our row as published, and its version."""
    return {"measured": len(row), "row": {p: [m.latency_ms, m.bandwidth_gbps] for p, m in row.items()},
            "version": version}


def _plan_gate(agent: Agent, run: Following) -> PlanGate:
    """The agent's checks of its leaders' plans (``plan_check.PlanGate``): a refusal is logged as an event and said
    in our heartbeat answers (``PeerStatus.refused``); the checkers' refusals, and whether they still check, are read
    from theirs."""
    cfg = agent.config

    def refused(plan: PlanRecord, reason: str) -> None:
        agent.events.write("plan_refused", epoch=plan.epoch, signer=plan.leader, reason=reason)
        agent.transport.announced.refused = max(agent.transport.announced.refused, plan.epoch)

    def statuses() -> Mapping[str, PeerStatus]:
        return agent.liveness.statuses() if agent.liveness is not None else {}

    return PlanGate(agent.peer_id, cfg.train, cfg.plan, cfg.emulation, agent._leaders, cfg.dht.peer_ttl_s,
                    agent.dht.read_links,
                    lambda _, trainers, peers, train: agent._leading.pricing.plan_workload(trainers, Membership(dict(peers)),
                                                                                          train),
                    refused, run.pass_over, run=cfg.run, vouchers=lambda: (run.progress_seen, run.progress_period_s()),
                    needed=cfg.membership.expect or cfg.membership.min_peers, stages=agent.stages,
                    rows_for=lambda plan: agent._leading.rows_to_check(plan), history=agent.dht.rows_read,
                    statuses=statuses)
