"""One epoch of an agent: follow an accepted plan to the last step (or until stopped).

The plan gives the topology (``pipelines[i][j]``: the peer holding stage j of pipeline i), hence our role,
pipeline neighbours and replica group. We dial them, build the stage exactly as every trainer does
(``runtime.session.StageTrainer``), and run steps; each step publishes a heartbeat (``ProgressRecord``:
epoch, steps done, loss, step time) and logs one line. After the last step we publish the final heartbeat
and wait until every peer of the topology has published its own: a receiver that got all it needs could
otherwise shut its daemon down while the acknowledgement of someone's last message is still on its way.

A spare (a member the plan gives no stage) idles until the trainers' heartbeats say they are done.

Churn: the epoch starts at the plan's ``start_step`` with each stage's state from the plan's source for it
(``restart.source_of``): a peer that kept it sends it to every trainer of the stage (a spare of this plan
too), or it comes from the last complete checkpoint, or from the seed at step 0. Every completed step is
kept (``StateKeeper``) and, every ``checkpoint.every_steps``, saved by replica 0 of each stage. A call that
fails (the configured deadline) *halts* the epoch, and so does a newer plan that starts at or before the
steps done (``should_halt``, asked at every step boundary): the agent publishes a halted heartbeat saying
which steps it keeps and returns ``EpochOutcome(halted=True)``; the leader re-plans from those heartbeats.
A failed peer is noticed by heartbeat pings (``churn.liveness``), which abort the epoch's pending calls, so
the data deadline (``call_timeout_s``, sized by the plan's predicted step time) is only a last resort.

Warm copies (``churn.warm_copies``): each stage's replica 0 sends the stage's state to the plan's backup peer
of the stage every ``PlanRecord.backup_every`` steps (and the epoch's source sends it the start state); every
trainer also writes its own state to its own disk at those steps (``StateStore``). The halted heartbeat
lists those copies (``holds``), so the leader can restart a lost stage from them.

Verified work (``[verify]``, ``verify.sum_check``): in a run that syncs every step, each replica group checks
every step's sums before they are applied. A member that fails a check is named (a log line and a
``verify_failed`` event per finding) and the epoch halts blaming it, with the evidence when the check has
some (the member's own signed statement), which the leader re-checks. The finder never applied the step, so
the states it keeps are all from before the tainted step. The same hook then runs the recompute check
(``verify.recompute_check``): each member's challenged micro-batches are redone by another replica of its stage
from the pipeline messages it committed to; a finder's halted heartbeat says ``refused``, so the re-plan rolls
every stage back to before the step (a neighbour that computed on a corrupt message may have applied it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2ptrain.agent.churn.epoch_states import (
    StateUnavailable,
    checkpoint_step,
    complete_held,
    connect_peer,
    keep,
    serve_states,
    start_backup_receiver,
    take_state,
    warm_copy,
)
from p2ptrain.agent.churn.stage_state import StateKeeper, send_retrying
from p2ptrain.agent.churn.state_store import StateStore
from p2ptrain.agent.churn.warm_copies import BackupSender, copy_part_numel
from p2ptrain.agent.config import CheckpointConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.errors import MessageRejected, PeerFailed, PeerTimeoutError, ProtocolError, StreamClosed
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.dht.node import SwarmDHT
from p2ptrain.net.dht.records import (
    MAX_ALSO,
    MAX_EVIDENCE_BYTES,
    MAX_HOLDS,
    MAX_MFU,
    PeerRecord,
    PlanRecord,
    ProgressRecord,
)
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import MessageKind, Tag
from p2ptrain.net.transport.status import FAIL, HALT, IDLE, TRAIN, PeerStatus
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.executor import StepWaits
from p2ptrain.runtime.session import StageTrainer, StepResult
from p2ptrain.runtime.throughput import Throughput, throughput
from p2ptrain.runtime.topology import Role, Topology
from p2ptrain.verify.config import VerifyConfig
from p2ptrain.verify.evidence import parts as evidence_parts
from p2ptrain.verify.recompute_check import RecomputeChecker
from p2ptrain.verify.sum_check import Finding, SumChecker, VerificationFailed, refusal
from p2ptrain.verify.sum_shadow import ShadowSums

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochOutcome:
    finished: bool  # every step of the run is done
    steps_done: int
    losses: tuple[float, ...] = ()
    halted: bool = False  # ended early for a re-plan (a failed call, or a newer plan)


@dataclass
class EpochContext:
    """What an epoch needs from its agent (the same for every epoch of the agent)."""

    me: str
    train: TrainConfig
    device: torch.device
    transport: Transport
    dht: SwarmDHT
    stop: StopSignal
    events: EventLog
    heartbeat: Heartbeat
    keeper: StateKeeper
    store: StateStore
    checkpoint: CheckpointConfig
    call_timeout_s: float
    # how much later than us a trainer may take the epoch up, checking the plan (the heartbeats watch that,
    # ``epoch_watch``): our first step's calls allow it on top of ``call_timeout_s``. 32 agents on two cores: a
    # trainer's first activation came from a neighbour still checking the plan 60 s on, and the epoch failed
    taking_after_s: float
    state_timeout_s: float  # the state hand-over: its sources may still be training up to the start step
    poll_s: float
    finish_timeout_s: float
    should_halt: Callable[[int | None], bool]  # at a step boundary (steps done; None for a spare)
    on_copy: Callable[[int, int], None] | None = None  # a warm copy (stage, step) was received
    compute_slowdown: float = 1.0  # emulated compute speed (``runtime.compute_speed``)
    link_bandwidth: Callable[[str], float | None] = lambda peer: None  # bytes/s we measured to a peer (None: not)
    time_scale: float = 1.0  # a plan's seconds in ours (emulation): its predicted step is cost_s × time_scale
    verify: VerifyConfig | None = None  # the checks of the members' work (None: none)
    # bulk evidence (a failed recompute's or a shard dispute's: epoch, step, bulk) found here while this agent
    # leads the epoch: its judge's
    on_evidence: Callable[[int, int, bytes], None] | None = None
    peak: tuple[float | None, str] = (None, "unknown")  # this device's peak TFLOP/s and its source (MFU)

    def set_status(self, state: str, epoch: int, step: int) -> None:
        """What heartbeat pings answer (``transport.status``)."""
        self.transport.status = PeerStatus(state, epoch, step)

    def holds(self, num_stages: int) -> tuple[tuple[int, int], ...]:
        """The copies to list in a heartbeat: the newest ``MAX_HOLDS``."""
        pairs = self.store.holds(num_stages)
        return tuple(sorted(pairs, key=lambda p: p[1])[-MAX_HOLDS:])


def topology_of(plan: PlanRecord) -> Topology:
    return Topology.from_rows(
        [[plan.peer_at(i, j) for j in range(plan.stages)] for i in range(plan.replicas)]
    )


class Heartbeat:
    """Publishes progress records off the training thread; at most one store in flight (a newer
    heartbeat replaces one still waiting), ``say`` publishes one after it for sure, ``flush`` publishes the last
    one for sure and waits. With ``traffic``, each
    record says the agent's control plane a minute (``ProgressRecord.traffic``)."""

    def __init__(self, dht: SwarmDHT, traffic: Callable[[], tuple[int, ...]] | None = None):
        self.dht, self._traffic = dht, traffic  # our control plane a minute, said in every record (the monitor)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-heartbeat")
        self._pending: concurrent.futures.Future | None = None

    def beat(self, record: ProgressRecord) -> None:
        if self._pending is not None and not self._pending.done():
            return  # the DHT is slow: skip this one rather than queue behind it
        self._pending = self._pool.submit(self._publish, record)

    def say(self, record: ProgressRecord) -> None:
        """Publish ``record`` after any store in flight, waiting for neither: one that others wait for."""
        self._pending = self._pool.submit(self._publish, record)

    def flush(self, record: ProgressRecord) -> None:
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
        self._publish(record)

    def _publish(self, record: ProgressRecord) -> None:
        try:
            if self._traffic is not None:
                record = dataclasses.replace(record, traffic=self._traffic())
            self.dht.publish_progress(record)
        except ProtocolError as e:
            logger.warning("heartbeat not published: %s", e)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


HALTING_ERRORS = (ProtocolError, TimeoutError, concurrent.futures.TimeoutError, StateUnavailable)


def run_epoch(plan: PlanRecord, ctx: EpochContext, peers: dict[str, PeerRecord]) -> EpochOutcome:
    topology = topology_of(plan)
    cfg = dataclasses.replace(ctx.train, stages=plan.stages, replicas=plan.replicas, layers=plan.layer_ranges)
    run = ctx.dht.keys.run_id
    # our mailbox takes this epoch's messages from now on: a peer whose state is its own starts at once, and an
    # agent that missed the epochs between (cut off, then back) would otherwise refuse them as too far ahead
    ctx.transport.set_window(run, plan.epoch, plan.start_step)
    ctx.set_status(TRAIN if ctx.me in topology.peers else IDLE, plan.epoch, plan.start_step)
    # we took the plan up: said at once, for the members that follow it on its checkers' word (``leadership.checkers``)
    ctx.heartbeat.say(ProgressRecord(plan.epoch, plan.start_step, None, 0.0, leader=plan.leader, plan=plan.digest()))
    step_s = plan.cost_s * ctx.time_scale
    sender = BackupSender(ctx.transport, run, plan.epoch, ctx.state_timeout_s,
                          lambda peer: copy_part_numel(ctx.link_bandwidth(peer), step_s), cfg.diloco_on)
    receiver = start_backup_receiver(plan, topology, cfg, ctx)
    try:
        return _run_epoch(plan, topology, cfg, ctx, peers, sender)
    finally:
        if receiver is not None:
            receiver.stop()
        sender.close()


def _run_epoch(plan: PlanRecord, topology: Topology, cfg: TrainConfig, ctx: EpochContext,
               peers: dict[str, PeerRecord], sender: BackupSender) -> EpochOutcome:
    try:
        sends = serve_states(plan, topology, cfg, ctx, peers, sender)
    except HALTING_ERRORS as e:
        return _halt(plan, ctx, plan.start_step, e)
    if ctx.me not in topology.peers:
        return _idle_as_spare(plan, topology, cfg, ctx, sends)
    role = topology.role_of(ctx.me)
    logger.info(
        "epoch %d: stage %d of pipeline %d (%d stages × %d replicas, leader %s, from step %d, predicted %.3f s/step)",
        plan.epoch, role.stage, role.replica, plan.stages, plan.replicas, plan.leader, plan.start_step, plan.cost_s,
    )
    ctx.events.write("role", epoch=plan.epoch, stage=role.stage, replica=role.replica, stages=plan.stages,
                     replicas=plan.replicas, leader=plan.leader, cost_s=plan.cost_s, start_step=plan.start_step)
    done = plan.start_step
    losses: list[float] = []
    findings: list[Finding] = []  # our checks' findings of this epoch, as they are made
    try:
        for peer in sorted(topology.neighbours(role)):
            connect_peer(ctx, peers, peer)
        trainer = StageTrainer(cfg, role, ctx.device, ctx.compute_slowdown)
        trainer.executor.before_update = ctx.keeper.fence  # the kept state's copy may still be reading
        verifier, recomputer = _install_verifier(plan, topology, role, cfg, trainer, ctx, findings)
        take_state(plan, role.stage, trainer, ctx)
        _wait_sends(sends, ctx.state_timeout_s)
        settle_heap()
        last_end = None
        for step in range(plan.start_step, cfg.steps):
            if ctx.stop.is_set():
                return EpochOutcome(False, done, tuple(losses))
            if ctx.should_halt(done):
                complete_held(ctx, trainer, done)
                return _halt(plan, ctx, done, None, _unverified(verifier, recomputer))
            busy_s, busy_cpu_s = trainer.executor.pacer.busy_s, trainer.executor.pacer.busy_cpu_s
            sent_before = ctx.transport.sent_bytes  # what the step sends: its calls, its checkpoint's and copies'
            started = time.perf_counter()
            between_s = started - last_end if last_end is not None else 0.0  # the last step's aftermath
            checked_s = 0.0  # the checks' time in the step's hook (``verify_s``)
            for checks in (verifier, recomputer):
                if checks is not None:
                    checks.begin_step(plan.epoch, step)
                    checked_s -= checks.seconds
            summed_cpu_s = verifier.cpu_seconds if verifier is not None else 0.0
            timeout_s = ctx.call_timeout_s + (ctx.taking_after_s if step == plan.start_step else 0.0)
            result = trainer.step(ctx.transport, ctx.dht.keys.run_id, plan.epoch, step, topology, timeout_s)
            checked_s += sum(checks.seconds for checks in (verifier, recomputer) if checks is not None)
            summed_cpu_s = verifier.cpu_seconds - summed_cpu_s if verifier is not None else None
            compute_s = trainer.executor.pacer.busy_s - busy_s  # our own compute, none of the waits (``claims``)
            compute_cpu_s = trainer.executor.pacer.busy_cpu_s - busy_cpu_s  # its CPU time: less, where it waited
            last_end = time.perf_counter()
            done = step + 1
            kept = keep(ctx, cfg, trainer, done)  # with DiLoCo: at rounds' ends
            ctx.set_status(TRAIN, plan.epoch, done)
            if result.loss is not None:
                losses.append(result.loss)
            if kept is not None:
                checkpoint_step(ctx, cfg, role.stage, role.replica, kept)
                warm_copy(plan, ctx, role.stage, role.replica, kept, trainer.module, sender)
            _report_step(plan, topology, role, cfg, ctx, step, result, _StepCosts(
                compute_s=compute_s, compute_cpu_s=compute_cpu_s, between_s=between_s,
                checked_s=checked_s if verifier is not None else None, sum_check_cpu_s=summed_cpu_s,
                sent_bytes=ctx.transport.sent_bytes - sent_before))
    except HALTING_ERRORS as e:
        if ctx.stop.is_set():
            return EpochOutcome(False, done, tuple(losses))
        return _halt(plan, ctx, done, _own_finding(e, findings), _unverified(verifier, recomputer))
    if verifier is not None:
        logger.info("epoch %d: every member's sums of stage %d held in the %d step(s) checked", plan.epoch,
                    role.stage, verifier.checked_steps)
    if recomputer is not None:
        logger.info("epoch %d: every one of the %d micro-batch(es) of stage %d's members recomputed here held "
                    "(the recompute check took %.3f s beside the next steps, and the steps waited %.3f s for it)",
                    plan.epoch, recomputer.recomputed, role.stage, recomputer.shadow_seconds, recomputer.seconds)
    if not _finish_together(plan, topology, cfg.steps, ctx):
        return _halt(plan, ctx, done, None)
    ctx.set_status(IDLE, plan.epoch, done)
    return EpochOutcome(True, done, tuple(losses))


@dataclass(frozen=True)
class _StepCosts:
    """What a step cost this agent beside its time: its own compute (wall and CPU), the time since the last step
    ended (that step's aftermath), the checks' time in its hook and the sum check's CPU time in it (None without
    the sum check), its bytes sent (its calls, its checkpoint's and copies')."""

    compute_s: float
    compute_cpu_s: float
    between_s: float
    checked_s: float | None
    sum_check_cpu_s: float | None
    sent_bytes: int


def _report_step(plan: PlanRecord, topology: Topology, role: Role, cfg: TrainConfig, ctx: EpochContext, step: int,
                 result: StepResult, costs: _StepCosts) -> None:
    """A finished step in the heartbeat's progress record, the events file and the log."""
    done, sync_every = step + 1, cfg.rounds.length
    speed = throughput(cfg.shape, cfg.global_batch_size * cfg.shape.seq_len, result.step_time_s, ctx.peak,
                       num_devices=len(topology.peers))  # the run's, with every trainer at our peak
    record = ProgressRecord(plan.epoch, done, result.loss, result.step_time_s, compute_s=costs.compute_s,
                            leader=plan.leader, plan=plan.digest(), sent_bytes=costs.sent_bytes, sync_every=sync_every,
                            mfu=record_mfu(_speed(speed)["mfu"]))
    (ctx.heartbeat.flush if done == cfg.steps else ctx.heartbeat.beat)(record)  # the last: others wait for it
    ctx.events.write("step", epoch=plan.epoch, step=done, loss=result.loss, step_time_s=result.step_time_s,
                     stage=role.stage, replica=role.replica, compute_s=round(costs.compute_s, 6),
                     compute_cpu_s=round(costs.compute_cpu_s, 6), between_s=round(costs.between_s, 6),
                     **_waits(result.waits), **_speed(speed), sent_bytes=costs.sent_bytes,
                     round=step // sync_every if sync_every > 1 else None,  # DiLoCo: the step's round
                     verify_s=round(costs.checked_s, 6) if costs.checked_s is not None else None,
                     sum_check_cpu_s=round(costs.sum_check_cpu_s, 6) if costs.sum_check_cpu_s is not None else None)
    logger.info("epoch %d step %d/%d%s (%.3f s, %.0f tokens/s)", plan.epoch, done, cfg.steps,
                "" if result.loss is None else f" loss {result.loss:.4f}", result.step_time_s, speed.tokens_per_s)


def _install_verifier(plan: PlanRecord, topology: Topology, role: Role, cfg: TrainConfig, trainer: StageTrainer,
                      ctx: EpochContext, findings: list[Finding]
                      ) -> tuple[SumChecker | ShadowSums | None, RecomputeChecker | None]:
    """The sum check of our stage's all-reduce and the recompute check of our group's micro-batches, every step
    (a run that syncs every step, with replicas; fp16 stages are not recomputed: their loss scale is their own;
    a one-stage plan has no pipeline messages to recompute: the whole-step check would be its). Where both run,
    each step's are checked in the next step's shadow (``sum_shadow``, ``recompute_check``); the sum check alone
    runs in the step's own hook. A DiLoCo run
    gets the sum check of each round's all-reduce of pseudo-gradients, before the outer step (plain rounds:
    not overlapped, one fragment); its replicas differ inside a round, so nothing is recomputed."""
    if ctx.verify is None or not ctx.verify.enabled or plan.replicas < 2:
        return None, None
    plain_rounds = not cfg.diloco_on or (cfg.diloco.fragments == 1 and not cfg.diloco.overlap)
    if not plain_rounds:
        return None, None

    def on_finding(finding: Finding) -> None:
        findings.append(finding)
        ctx.events.write("verify_failed", epoch=finding.epoch, step=finding.step, peer=finding.member,
                         check=finding.check, ratio=finding.ratio if finding.ratio < float("inf") else None,
                         reason=finding.reason, evidence=finding.evidence is not None)

    reducer = trainer.executor.reducer
    verifier = SumChecker(ctx.dht.signing_key, ctx.dht.keys.run_id, role.stage, topology.group(role.stage),
                             reducer.feedback.codec, rows=ctx.verify.sketch_rows, false_alarm=ctx.verify.false_alarm,
                             running=ctx.verify.running, on_finding=on_finding, device=ctx.device)
    if cfg.precision == "fp16" or plan.stages == 1 or cfg.diloco_on:  # no pipeline messages to recompute
        reducer.verifier = verifier
        return verifier, None
    executor = trainer.executor
    recomputer = RecomputeChecker(ctx.dht.signing_key, ctx.dht.keys.run_id, plan.epoch, role, topology, trainer.module,
                               executor.data, executor.wire, executor.num_micro_batches, executor.boundary_width,
                               cfg.precision, ctx.verify.rate, on_finding=on_finding, probation=plan.on_probation,
                               last_step=cfg.steps - 1, verifiers=ctx.verify.verifiers)  # each step checked in the next one's shadow
    # the sums of each step checked in the next one's shadow too, over its link, apart from any step's own messages
    shadow = ShadowSums(verifier, topology.group(role.stage), len(reducer.buckets) + 2, cfg.steps - 1)
    trainer.link_wrapper = lambda link: recomputer.wrap(shadow.wrap(link))

    def check_step(records, rank, n, exchange) -> None:
        shadow(records, rank, n, exchange)  # the sums first: the recompute check's reveals are larger
        recomputer.check_step()

    reducer.verifier = check_step
    return shadow, recomputer


def _wait_sends(sends: list[concurrent.futures.Future], timeout_s: float) -> None:
    for future in sends:
        future.result(timeout=timeout_s + 5.0)


def freeze_heap() -> None:
    """Collect the garbage once, then freeze what survives (``gc.freeze``): the libraries an agent runs on
    (torch, hivemind, their modules and caches) are some 300,000 objects that every full collection would
    scan again; on the training thread such a collection took 0.2-0.3 s every few steps, in the middle of a
    forward or backward pass (the e2e benchmark's int8 steps of 1.13 s took 1.46 s then). Called once, when
    the agent starts; a fork server froze its own heap before it forked (``runtime.forkserver``), so then the
    collection scans only what the agent made since."""
    gc.collect()
    gc.freeze()


def settle_heap() -> None:
    """An epoch starts on a collected heap: what the epoch before left in reference cycles (its trainer: the
    module, the optimizer, the all-reduce's hooks hold their owners) is freed before the first step, not by a
    collection in the middle of one. Only what the agent made since ``freeze_heap`` is scanned."""
    gc.collect()


def _waits(waits: StepWaits | None) -> dict[str, float]:
    """A step event's fields for where the step waited (``executor.StepWaits``)."""
    if waits is None:
        return {}
    return {"recv_wait_s": round(waits.recv_s, 6), "reduce_wait_s": round(waits.reduce_s, 6),
            "send_wait_s": round(waits.send_s, 6)}


def record_mfu(mfu: float | None) -> float | None:
    """The MFU a progress record may carry: past ``MAX_MFU`` (a device peak measured far too low, as a profile
    taken on a loaded machine is) it says nothing, and the record leaves it out rather than refuse itself."""
    return mfu if mfu is not None and math.isfinite(mfu) and 0.0 <= mfu <= MAX_MFU else None


def _speed(speed: Throughput) -> dict[str, float | None]:
    """A step event's tokens per second and MFU (``runtime.throughput``; None without a peak)."""
    return {"tokens_per_s": round(speed.tokens_per_s, 1),
            "mfu": None if speed.mfu is None else float(f"{speed.mfu:.4g}")}


def _unverified(*checks) -> int | None:
    """The earliest step applied whose check (in the next step's shadow) has not passed yet, if any."""
    steps = [c.unverified for c in checks if getattr(c, "unverified", None) is not None]
    return min(steps) if steps else None


def _own_finding(error: BaseException, findings: list[Finding]) -> BaseException:
    """What we halt on: ``error``, unless our checks found a member's work wrong in this epoch and ``error`` is
    not that refusal (the check runs in the next step's shadow: the abort of a peer that halted first, or a call
    to it, can end the epoch before our finding is raised). Our finding is what we refuse, and the leader must
    read it: a receiver that caught its sender, but halted on the sender's own abort, was blamed by the sender's
    refusal alone (the campaign's ``clean_commit`` at two colluding members)."""
    if isinstance(error, VerificationFailed) or not findings:
        return error
    ours = refusal(findings)
    logger.warning("halting on our finding against %s (%s check of step %d), not on %s: %s", ours.peer,
                   ours.finding.check, ours.finding.step, type(error).__name__, error)
    return ours


def _halt(plan: PlanRecord, ctx: EpochContext, done: int, error: BaseException | None,
          unverified: int | None = None) -> EpochOutcome:
    """Stop this epoch: say in a heartbeat which states we keep (of this epoch, or of an earlier one when
    this epoch failed before we took up our stage), and wait for the next plan. Only checked states: none
    after a step whose check failed (``error``'s finding) or has not ended (``unverified``, the recompute
    check's shadow: ``verify.recompute_check``)."""
    keeper = ctx.keeper
    held = keeper.latest_step is not None and keeper.num_stages == plan.stages
    step, kept = (keeper.latest_step, keeper.kept) if held else (done, 0)
    caps = [c for c in (unverified, error.finding.step if isinstance(error, VerificationFailed) else None)
            if c is not None]
    if held and caps and step > min(caps):  # the state after step s is the state before step s + 1
        kept, step = max(0, kept - (step - min(caps))), min(caps)
    why = f"{type(error).__name__}: {error}" if error is not None else "a newer plan"
    ctx.set_status(FAIL if error is not None else HALT, plan.epoch, done)
    holds = ctx.holds(plan.stages)
    logger.warning("epoch %d halted after step %d (%s); keeping %d state(s) of stage %s up to step %d and %d "
                   "copies, waiting for the next plan", plan.epoch, done, why, kept, keeper.stage, step, len(holds))
    ctx.events.write("halted", epoch=plan.epoch, step=done, kept=kept, stage=keeper.stage, reason=why,
                     holds=[list(h) for h in holds])
    blame = blamed_peer(error, plan)
    evidence = b""
    if isinstance(error, VerificationFailed) and blame is not None and error.finding.evidence is not None:
        if len(error.finding.evidence) <= MAX_EVIDENCE_BYTES:
            evidence = error.finding.evidence
            if error.finding.bulk is not None:  # announced in the heartbeat: sent to the leader before it
                _send_evidence(plan, ctx, error.finding.step, error.finding.bulk)
        else:  # a stage of very many buckets: the blame goes as our word (``docs/verification.md``)
            logger.warning("the evidence against %s (%d bytes) does not fit a heartbeat; blaming it without",
                           blame, len(error.finding.evidence))
    ctx.heartbeat.flush(ProgressRecord(plan.epoch, step, None, 0.0, halted=True, kept=kept,
                                       stage=keeper.stage if held else None, holds=holds, blame=blame,
                                       leader=plan.leader, plan=plan.digest(), evidence=evidence,
                                       refused=isinstance(error, VerificationFailed) and blame is not None,
                                       also=error.also[:MAX_ALSO] if isinstance(error, VerificationFailed)
                                       and blame is not None else ()))
    return EpochOutcome(False, done, halted=True)


def _send_evidence(plan: PlanRecord, ctx: EpochContext, step: int, bulk: bytes) -> None:
    """The bulk of a finding's evidence (``verify.evidence``), to the plan's leader that judges it: in the
    background, retried while it refuses (it takes the parts once it read our heartbeat); kept here when we lead."""
    if plan.leader == ctx.me:
        if ctx.on_evidence is not None:
            ctx.on_evidence(plan.epoch, step, bulk)
        return
    payload = torch.frombuffer(bytearray(bulk), dtype=torch.uint8)
    for part, (start, end) in enumerate(evidence_parts(len(bulk))):
        tag = Tag(ctx.dht.keys.run_id, plan.epoch, step, MessageKind.EVIDENCE, 0, part)
        future = send_retrying(ctx.transport, plan.leader, tag, payload[start:end], ctx.state_timeout_s)
        future.add_done_callback(lambda f, tag=tag: f.exception() is None or logger.warning(
            "the evidence %s did not reach the leader %s: %s", tag, plan.leader, f.exception()))
    logger.info("sent the leader %s the evidence of step %d (%d bytes) to judge", plan.leader, step, len(bulk))


def blamed_peer(error: BaseException | None, plan: PlanRecord) -> str | None:
    """The plan member whose own call failed our epoch (it timed out, broke, or was refused by it), if any.
    An epoch aborted because *another* peer failed (``PeerFailed``) blames the member one of our calls had
    waited on for most of its deadline by then (``PeerFailed.stuck_on``): we were stuck behind it, and would
    have blamed it once that call timed out; without such a call it blames nobody."""
    if isinstance(error, PeerTimeoutError | StreamClosed | MessageRejected) and error.peer in plan.membership:
        return error.peer
    if isinstance(error, VerificationFailed) and error.peer in plan.membership:  # its work failed a check
        return error.peer
    if isinstance(error, PeerFailed) and error.stuck_on in plan.membership:
        return error.stuck_on
    return None


def _finished_peers(dht: SwarmDHT, epoch: int, steps: int) -> set[str]:
    try:
        progress = dht.read_progress()
    except ProtocolError as e:
        logger.warning("reading progress failed: %s", e)
        return set()
    return {p for p, r in progress.items() if r.epoch == epoch and r.step >= steps}


def _finish_together(plan: PlanRecord, topology: Topology, steps: int, ctx: EpochContext) -> bool:
    """Wait for the other trainers' last heartbeats; False if a newer plan came first (a peer failed in
    the last step: the run goes on without us leaving)."""
    waiting = set(topology.peers) - {ctx.me}
    deadline = time.monotonic() + ctx.finish_timeout_s
    while waiting and not ctx.stop.is_set() and time.monotonic() < deadline:
        waiting -= _finished_peers(ctx.dht, plan.epoch, steps)
        if waiting:
            if ctx.should_halt(steps):
                return False
            ctx.stop.wait(min(ctx.poll_s, 0.25))
    if waiting and not ctx.stop.is_set():
        logger.warning("leaving before %d trainer(s) said they were done: %s", len(waiting), ", ".join(sorted(waiting)))
    return True


def _publish_spare_holdings(plan: PlanRecord, ctx: EpochContext) -> None:
    keeper, holds = ctx.keeper, ctx.holds(plan.stages)
    own = keeper.latest_step is not None and keeper.num_stages == plan.stages
    if not own and not holds:
        return
    ctx.heartbeat.flush(ProgressRecord(plan.epoch, keeper.latest_step if own else plan.start_step, None, 0.0,
                                       halted=True, kept=keeper.kept if own else 0,
                                       stage=keeper.stage if own else None, holds=holds,
                                       leader=plan.leader, plan=plan.digest()))


def _idle_as_spare(plan: PlanRecord, topology: Topology, cfg: TrainConfig, ctx: EpochContext,
                   sends: list[concurrent.futures.Future]) -> EpochOutcome:
    logger.info("epoch %d: spare (the plan uses %d of %d members); waiting for the trainers to finish",
                plan.epoch, len(topology.peers), len(plan.membership))
    ctx.events.write("role", epoch=plan.epoch, stage=None, replica=None, stages=plan.stages, replicas=plan.replicas,
                     leader=plan.leader, cost_s=plan.cost_s, start_step=plan.start_step)
    try:
        _wait_sends(sends, ctx.state_timeout_s)
    except HALTING_ERRORS as e:
        return _halt(plan, ctx, plan.start_step, e)
    published = None
    while not ctx.stop.wait(ctx.poll_s):
        if ctx.store.version != published:
            # what this spare keeps (states it trained before, warm copies): sources for the next re-plan
            published = ctx.store.version
            _publish_spare_holdings(plan, ctx)
        if set(topology.peers) <= _finished_peers(ctx.dht, plan.epoch, cfg.steps):
            logger.info("the trainers finished all %d steps", cfg.steps)
            return EpochOutcome(True, 0)
        if ctx.should_halt(None):
            return EpochOutcome(False, 0, halted=True)
    return EpochOutcome(False, 0)
