"""An epoch's stage states (``agent.epoch``): taken at its start from the plan's source of each stage, kept at
its committed steps, written to the agent's own disk and sent to the stage's backup peer as warm copies,
checkpointed, and served to the next epoch's trainers.

- ``take_state``: the state a trainer starts from: the seed, the last checkpoint, its own store or the source
  peer's transfer (``restart.source_of``); ``serve_states``: the states this agent is the source of, to their
  trainers and backups.
- ``keep``, ``complete_held``: the states kept after each committed step (with DiLoCo's overlap, a round's end
  held until its mean is in).
- ``warm_copy``, ``start_backup_receiver``: the warm copies sent and received (``churn.warm_copies``);
  ``checkpoint_step``: replica 0's checkpoint every ``checkpoint.every_steps``.
- ``connect_peer``: dial a plan's peer at its recorded addresses.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

import torch

from p2ptrain.agent.churn.restart import CHECKPOINT, INIT, source_of
from p2ptrain.agent.churn.stage_state import recv_state, send_state
from p2ptrain.agent.churn.warm_copies import BackupReceiver, BackupSender
from p2ptrain.errors import ProtocolError
from p2ptrain.model.stage import build_stage
from p2ptrain.net.dht.records import PeerRecord, PlanRecord
from p2ptrain.runtime.checkpoint import (
    load_stage,
    load_state_tensors,
    outer_tensors,
    save_stage,
    state_tensors,
)
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.session import StageTrainer
from p2ptrain.runtime.topology import Topology

if TYPE_CHECKING:
    from p2ptrain.agent.epoch import EpochContext

logger = logging.getLogger(__name__)


class StateUnavailable(RuntimeError):
    """This agent is a plan's source of a state it does not keep (the plan was made on stale heartbeats)."""


def keep(ctx: EpochContext, cfg: TrainConfig, trainer: StageTrainer, done: int) -> int | None:
    """Keep the committed state after ``done`` (the states re-plans restart from); the step of the state kept
    now, if any. With DiLoCo's ``overlap`` a round's end is complete only with its mean, which comes in
    ``tau`` steps later: it is held until then (``StateKeeper.hold``) and kept then, with the anchor and
    momentum that mean gave; the run's last step is complete at once (it applies every mean). With fragments
    (``DiLoCoConfig.fragments``) a state is fragment 0's round end and holds every fragment's anchor: the others'
    rounds restart from theirs."""
    executor = trainer.executor
    fragments = cfg.diloco_on and cfg.diloco.fragments > 1
    if not cfg.diloco_on or not cfg.diloco.overlap or done == cfg.steps:
        if not cfg.committed(done):
            return None
        if fragments and done < cfg.steps:  # the other fragments are mid-round: the state holds their anchors
            ctx.keeper.hold(done, trainer.module, trainer.optimizer, executor.outer)
            return ctx.keeper.complete(outer_tensors(trainer.module, executor.outer))
        ctx.keeper.record(done, trainer.module, trainer.optimizer, executor.outer)
        return done
    kept = None
    held = ctx.keeper.held_step
    if held is not None and not executor.mean_pending(held):  # its means are in
        kept = ctx.keeper.complete(outer_tensors(trainer.module, executor.outer))
    if cfg.committed(done):
        ctx.keeper.hold(done, trainer.module, trainer.optimizer, executor.outer)
    return kept


def complete_held(ctx: EpochContext, trainer: StageTrainer, done: int) -> None:
    """An epoch that stops at a round's end (a new plan starts there) completes its held state: it waits for
    that round's all-reduce (within its calls' deadlines) and keeps the state with its mean."""
    if ctx.keeper.held_step == done:
        trainer.executor.settle_outer()
        ctx.keeper.complete(outer_tensors(trainer.module, trainer.executor.outer))


def serve_states(plan: PlanRecord, topology: Topology, cfg: TrainConfig, ctx: EpochContext,
                 peers: dict[str, PeerRecord], sender: BackupSender) -> list[concurrent.futures.Future]:
    """Send the states this agent is the plan's source of to the stages' other trainers and, as a warm
    copy, to the stage's backup peer (before this agent takes up its own role, which replaces what it
    keeps)."""
    sends: list[concurrent.futures.Future] = []
    for stage in range(plan.stages):
        if source_of(plan, stage) != ctx.me:
            continue
        tensors = ctx.store.get(stage, plan.stages, plan.start_step)
        if tensors is None:
            raise StateUnavailable(f"the plan of epoch {plan.epoch} has this agent send stage {stage}'s state "
                                   f"after step {plan.start_step}, which it does not keep")
        module = build_stage(cfg.shape, stage, cfg.stages, cfg.seed, torch.device("cpu"), cfg.layers)  # names, shapes
        for replica in range(plan.replicas):
            peer = topology.holder(stage, replica)
            if peer != ctx.me:
                connect_peer(ctx, peers, peer)
                sends += send_state(ctx.transport, peer, ctx.dht.keys.run_id, plan.epoch, plan.start_step, tensors,
                                    module, ctx.state_timeout_s, stage, cfg.diloco_on)
                logger.info("epoch %d: sending stage %d's state after step %d to peer %s", plan.epoch, stage,
                            plan.start_step, peer)
        backup = plan.backup_of(stage)
        if backup is not None and backup != ctx.me:
            sender.send(backup, stage, plan.start_step, tensors, module)
    return sends


def start_backup_receiver(plan: PlanRecord, topology: Topology, cfg: TrainConfig,
                           ctx: EpochContext) -> BackupReceiver | None:
    """Receive the warm copies this agent keeps in this epoch: from each such stage's source (its start
    state), then from the stage's replica 0 (every ``backup_every`` steps)."""
    senders: dict[int, list[tuple[str, int]]] = {}
    for stage in range(plan.stages):
        if plan.backup_of(stage) != ctx.me:
            continue
        source, first = source_of(plan, stage), topology.holder(stage, 0)
        chain = []
        if source not in (INIT, CHECKPOINT, ctx.me):
            chain.append((source, 0))
        if not chain or source != first:
            chain.append((first, 0))
        senders[stage] = chain
    if not senders:
        return None
    ctx.transport.set_window(ctx.dht.keys.run_id, plan.epoch, plan.start_step)

    def module_of(stage: int) -> torch.nn.Module:
        return build_stage(cfg.shape, stage, cfg.stages, cfg.seed, torch.device("cpu"), cfg.layers)

    return BackupReceiver(ctx.transport, ctx.store, ctx.dht.keys.run_id, plan.epoch, plan.stages, senders,
                          module_of, on_copy=ctx.on_copy, poll_s=ctx.poll_s, with_outer=cfg.diloco_on).start()


def warm_copy(plan: PlanRecord, ctx: EpochContext, stage: int, replica: int, done: int, module: torch.nn.Module,
          sender: BackupSender) -> None:
    """At a warm-copy step: our own state to our disk, and replica 0's to the stage's backup peer. With
    DiLoCo only a round's end is one (the states of a round's inside are not restarted from)."""
    every = plan.backup_every
    if not every or done % every:
        return
    tensors = ctx.keeper.get(stage, plan.stages, done)
    assert tensors is not None  # just recorded
    ctx.store.save_own(stage, plan.stages, done, tensors)
    backup = plan.backup_of(stage)
    if replica == 0 and backup is not None:
        sender.send(backup, stage, done, tensors, module)


def connect_peer(ctx: EpochContext, peers: dict[str, PeerRecord], peer: str) -> None:
    """Dial a peer of the plan at its recorded addresses; without a record in our view (it lapsed for a
    moment on a busy DHT) we keep the connection the membership poll opened, and a dead peer fails the
    epoch through its calls."""
    if peer not in peers or not peers[peer].maddrs:
        logger.info("epoch: no address of peer %s in our view; using the connection we have", peer)
        return
    try:
        ctx.transport.connect(peer, peers[peer].maddrs, ctx.call_timeout_s)
    except ProtocolError:
        raise  # a deadline: the epoch halts
    except Exception as e:  # the daemon raises its own types for a peer it cannot dial
        logger.warning("epoch: cannot dial peer %s (%s); its calls will tell", peer, e)


def take_state(plan: PlanRecord, stage: int, trainer: StageTrainer, ctx: EpochContext) -> None:
    """Load stage ``stage``'s state after ``PlanRecord.start_step`` from the plan's source of it."""
    step, source = plan.start_step, source_of(plan, stage)
    started = time.monotonic()
    if source == INIT:
        tensors = None  # the trainer was just built from the seed
    elif source == CHECKPOINT:
        try:
            tensors = load_stage(ctx.checkpoint.dir or "", step, stage, plan.stages, ctx.train.model)
        except (ValueError, OSError) as e:
            raise StateUnavailable(f"epoch {plan.epoch} starts stage {stage} from a checkpoint: {e}") from e
    elif source == ctx.me:
        tensors = ctx.store.get(stage, plan.stages, step)
        assert tensors is not None  # serve_states checked it
    else:
        ctx.transport.set_window(ctx.dht.keys.run_id, plan.epoch, step)
        tensors = recv_state(ctx.transport, source, ctx.dht.keys.run_id, plan.epoch, step, trainer.module,
                             ctx.state_timeout_s, stage, trainer.cfg.diloco_on)
    outer = trainer.executor.outer  # DiLoCo: the state is a round's end, whose parameters are the anchor
    if tensors is not None:
        load_state_tensors(trainer.module, trainer.optimizer, tensors, outer)
    tensors = tensors if tensors is not None else state_tensors(trainer.module, trainer.optimizer, outer=outer)
    ctx.keeper.reset(stage, plan.stages, step, tensors)
    if step > 0:
        ctx.store.save_own(stage, plan.stages, step, tensors)  # a warm-copy step: the backups get it too
    where = {INIT: "the seed", CHECKPOINT: "the checkpoint", ctx.me: "this agent"}.get(source, f"peer {source}")
    took_s = time.monotonic() - started
    logger.info("epoch %d: stage %d's state after step %d from %s (%.2f s)", plan.epoch, stage, step, where, took_s)
    ctx.events.write("state", epoch=plan.epoch, stage=stage, step=step, source=source, seconds=took_s)


def checkpoint_step(ctx: EpochContext, cfg: TrainConfig, stage: int, replica: int, done: int) -> None:
    every = ctx.checkpoint.every_steps
    if not every or replica != 0 or done % every:  # a kept state: with DiLoCo, at rounds' ends only
        return
    tensors = ctx.keeper.get(stage, cfg.stages, done)
    assert tensors is not None
    save_stage(ctx.checkpoint.dir, done, stage, cfg.stages, cfg.model, cfg.seed, tensors, cfg.shape)
    ctx.events.write("checkpoint", step=done, stage=stage)
