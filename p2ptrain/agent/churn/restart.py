"""Where a re-planned epoch starts, and from whose state: pure functions (no I/O) over what the leader read.

Invariant (the *committed state*): the state of stage j after step s is the same wherever it was computed
(every replica applies the same all-reduced sum; float32 reduction order aside when the replica count
changes), so any copy of it — a surviving replica's, a checkpoint's, or the seed's at s = 0 — may seed a new
epoch that starts at step s. Training from there redoes the lost steps on the unchanged global batch, so
the loss curve is the uninterrupted run's.

Why two kept states suffice (``keep_states`` = 2): inside one epoch every trainer that completed step t
received a message of step t from each pipeline neighbour and each replica of its group, and those peers
sent it only after completing step t − 1; the plan's pipelines and groups connect every trainer, so the
trainers' completed-step counts differ by at most one. With s = min over stages of (max over a stage's
surviving replicas of steps completed), every count is in {s − 1, s, s + 1}: each stage has a replica
holding step s (its latest or the one before), replicas ahead roll back to it, replicas behind fetch it.

``restart_point`` generalises this to what the halted peers report they keep (their last ``kept`` steps),
the warm copies they hold (``ProgressRecord.holds``: other stages' states sent to them every
``backup_every`` steps, and their own copies on disk, ``churn.warm_copies``), plus the complete checkpoints of a
shared directory: the largest step for which every stage has a source. When every replica of a stage is
gone, that is its last warm copy's step (every trainer keeps its own state at those steps too), else the
last complete checkpoint, else step 0 (the seed).

DiLoCo (``[train] sync = "diloco"``): inside a round each replica trains on its own shard, so replicas of a
stage agree only at a round's end (after the outer step), and those are the only committed states
(``Rounds``): trainers keep their last two rounds' ends, warm copies and checkpoints are taken at rounds'
ends, and a re-plan restarts from one. The same argument bounds what they keep: a round's end needs every
replica of the stage (the pseudo-gradients' all-reduce), so trainers' completed-round counts differ by at
most one. The rule is *redo the round with the survivors*: what a round's inside computed is dropped and
the round is trained again by the new plan's pipelines on their new shards; every replica of a stage starts
it with the parameters (= the outer anchor) and outer momentum all replicas share and the inner AdamW moments
of the stage's source (one replica's: replicas' inner moments differ), which a single-process reference can
replay (``reference.train_reference``'s ``replans``). Joiners enter at a round's end (``join_start``).

With ``[train.diloco] overlap`` a round's all-reduce finishes during the next round, so the state of a
round's end (the anchor and momentum its mean gives, with the inner moments of that end) is complete one
round later (``epoch_states.keep``: ``StateKeeper.hold`` then ``complete``), or when an epoch that stops there has
waited for it (``epoch_states.complete_held``); trainers keep only complete states, so a failure redoes up to two
rounds, and every replica restarts from the anchor (not from its own guess), as the reference replays it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from p2ptrain.model.outer import EVERY_STEP, Rounds
from p2ptrain.net.dht.records import SOURCE_CHECKPOINT, SOURCE_INIT, PlanRecord

CHECKPOINT = "checkpoint"
INIT = "init"


@dataclass(frozen=True)
class Holding:
    """What a live peer keeps: stage ``stage``'s states after steps ``first`` … ``last``; ``copy``: a warm
    copy (of a stage it does not train, or on its disk), not a trainer's kept state."""

    stage: int
    first: int
    last: int
    copy: bool = False

    def holds(self, stage: int, step: int) -> bool:
        return stage == self.stage and self.first <= step <= self.last


def copies_of(holds: Iterable[tuple[int, int]]) -> list[Holding]:
    """``ProgressRecord.holds`` pairs as holdings."""
    return [Holding(stage, step, step, copy=True) for stage, step in holds]


@dataclass(frozen=True)
class Restart:
    step: int  # the new epoch starts with this many steps completed
    sources: tuple[str, ...]  # per stage: a peer ID, CHECKPOINT or INIT
    lost_stages: tuple[int, ...] = ()  # stages no live trainer kept any state of
    from_copy: tuple[int, ...] = ()  # stages that restart from a warm copy

    @property
    def from_checkpoint(self) -> bool:
        return CHECKPOINT in self.sources


def restart_point(num_stages: int, holdings: Mapping[str, Holding | Collection[Holding]],
                  checkpoints: Iterable[int] = (), rounds: Rounds = EVERY_STEP) -> Restart:
    """The largest committed step every stage can start from: a live holder (a trainer's kept state before
    a warm copy, then the lowest peer ID), else a complete checkpoint of that step, else the seed at 0."""
    held = [(p, h) for p, hs in holdings.items() for h in ([hs] if isinstance(hs, Holding) else hs)]
    checkpoint_steps = {s for s in checkpoints if rounds.committed(s)}
    candidates = {0} | checkpoint_steps | {s for _, h in held for s in range(h.first, h.last + 1) if rounds.committed(s)}
    lost = tuple(j for j in range(num_stages) if not any(h.stage == j and not h.copy for _, h in held))
    for step in sorted(candidates, reverse=True):
        sources, from_copy = [], []
        for stage in range(num_stages):
            holders = sorted((h.copy, p) for p, h in held if h.holds(stage, step))
            if holders:
                sources.append(holders[0][1])
                if holders[0][0]:
                    from_copy.append(stage)
            elif step in checkpoint_steps:
                sources.append(CHECKPOINT)
            elif step == 0:
                sources.append(INIT)
            else:
                break
        else:
            return Restart(step, tuple(sources), lost, tuple(from_copy))
    raise AssertionError("step 0 always has a source")  # unreachable: the seed covers step 0


def holding_of(plan: PlanRecord, peer: str, step: int, kept: int, stage: int | None = None,
               rounds: Rounds = EVERY_STEP) -> Holding | None:
    """What ``peer`` keeps after halting in ``plan``'s epoch: ``kept`` committed states up to ``step`` of
    ``stage`` (None: of its stage in ``plan``, from the epoch's start on)."""
    if kept < 1:
        return None
    first = step - (kept - 1) * rounds.length
    if stage is not None:
        return Holding(stage, first, step) if stage < plan.stages else None
    position = plan.position_of(peer)
    if position is None:
        return None
    return Holding(position[1], max(first, plan.start_step), step)


def source_indices(sources: Iterable[str], membership: tuple[str, ...]) -> tuple[int, ...]:
    """``Restart.sources`` as ``PlanRecord.sources`` (member indices or the sentinels)."""
    codes = {CHECKPOINT: SOURCE_CHECKPOINT, INIT: SOURCE_INIT}
    return tuple(codes[s] if s in codes else membership.index(s) for s in sources)


def source_of(plan: PlanRecord, stage: int) -> str:
    """Where stage ``stage``'s state at ``PlanRecord.start_step`` comes from: a peer ID, CHECKPOINT or INIT."""
    if not plan.sources:
        return INIT if plan.start_step == 0 else CHECKPOINT
    code = plan.sources[stage]
    if code == SOURCE_CHECKPOINT:
        return CHECKPOINT
    if code == SOURCE_INIT:
        return INIT
    return plan.membership[code]


def join_start(done_by_peer: Iterable[int], epoch_start: int = 0, rounds: Rounds = EVERY_STEP) -> int:
    """Where an epoch that admits joiners starts while the current one still trains: two steps past the
    furthest progress seen. Nobody can complete a step beyond it (it needs every trainer, and each stops
    there), and every trainer then holds it, so no state is lost and no step is redone. The current epoch's
    start step counts as progress: its trainers hold it before any of them has said so (a leader new to the
    epoch may read no progress of it yet, and must not start the next epoch behind it). With DiLoCo: the
    first round's end from there (``Rounds.next_committed``)."""
    return rounds.next_committed(max([*done_by_peer, epoch_start]) + 2)
