"""Which peer sends which tag: a receiver takes a message only from the peer its plan has send it. Pure.

``Mailbox.senders`` admits the members of the plans (and live peers) with a budget each; this is the finer
check on the header (``Mailbox.sends_tag``), before any payload is read: in the plan of the tag's epoch,
the sender must be the peer that sends this receiver that kind of message.

| kind | the receiver, in the plan | its only senders |
|---|---|---|
| ``activation`` | stage j > 0 of pipeline i | stage j − 1 of pipeline i |
| ``activation_grad`` | stage j < S − 1 of pipeline i | stage j + 1 of pipeline i |
| ``reduce_shard``, ``gather_shard``, ``commit``, ``sketch``, ``reveal`` | stage j | the other replicas of stage j |
| ``pipe_commit`` | stage j of pipeline i | the other replicas of stage j, stages j ± 1 of pipeline i |
| ``grad_norm`` | stage j of pipeline i | the other stages of pipeline i |
| ``state`` (micro_batch: the stage) | a trainer of that stage | the plan's source of the stage |
| ``backup`` (micro_batch: the stage) | the stage's backup peer | the stage's source, its replica 0 |
| ``evidence`` | the plan's leader | the plan's members (a finder's evidence, ``verify.evidence``) |
| any other kind | a trainer | its pipeline neighbours and replica group |

"Any other kind" keeps a new runtime kind working (a compressed part, a scale) without letting a peer with
no tensors to exchange with us send it. A tag whose epoch no plan we know has (we have not read that plan
yet; the mailbox's epoch window bounds how far ahead) is left to the budgets: refusing it would refuse an
honest neighbour that read the new plan a poll before we did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from p2ptrain.agent.churn.restart import source_of
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.transport.messages import MessageKind, Tag

GROUP_KINDS = frozenset({MessageKind.REDUCE_SHARD, MessageKind.GATHER_SHARD, MessageKind.COMMIT, MessageKind.SKETCH,
                         MessageKind.REVEAL})


def sender_problem(plan: PlanRecord, me: str, sender: str, tag: Tag) -> str | None:
    """Why ``plan`` does not have ``sender`` send ``me`` the message ``tag`` (None: it does)."""
    kind, stage = tag.kind, tag.micro_batch
    if kind == MessageKind.BACKUP:
        if stage >= plan.stages or plan.backup_of(stage) != me:
            return f"epoch {plan.epoch}'s plan keeps no copy of stage {stage} on this agent"
        allowed = {source_of(plan, stage), plan.peer_at(0, stage)}
        return None if sender in allowed else f"epoch {plan.epoch}'s plan has stage {stage}'s copy come from " \
                                              f"{', '.join(sorted(allowed))}"
    if kind == MessageKind.EVIDENCE:
        if plan.leader != me:
            return f"this agent does not lead epoch {plan.epoch}"
        return None if sender in plan.membership and sender != me else f"peer {sender} is no member of epoch {plan.epoch}"
    position = plan.position_of(me)
    if position is None:
        return f"this agent trains nothing in epoch {plan.epoch}"
    row, own = position
    if kind == MessageKind.STATE:
        if stage != own:
            return f"this agent holds stage {own} in epoch {plan.epoch}, not stage {stage}"
        allowed = {source_of(plan, stage)}
    elif kind == MessageKind.ACTIVATION:
        allowed = {plan.peer_at(row, own - 1)} if own > 0 else set()
    elif kind == MessageKind.ACTIVATION_GRAD:
        allowed = {plan.peer_at(row, own + 1)} if own + 1 < plan.stages else set()
    elif kind == MessageKind.GRAD_NORM:
        allowed = {plan.peer_at(row, j) for j in range(plan.stages)} - {me}
    elif kind in GROUP_KINDS:
        allowed = {plan.peer_at(i, own) for i in range(plan.replicas)} - {me}
    else:  # ``pipe_commit`` too
        neighbours = {plan.peer_at(row, j) for j in (own - 1, own + 1) if 0 <= j < plan.stages}
        allowed = neighbours | {plan.peer_at(i, own) for i in range(plan.replicas)} - {me}
    if sender in allowed:
        return None
    if not allowed:
        return f"nobody sends {kind} to stage {own} of pipeline {row} in epoch {plan.epoch}"
    return f"epoch {plan.epoch}'s plan has {kind} for stage {own} of pipeline {row} come from " \
           f"{', '.join(sorted(allowed))}"


@dataclass(frozen=True)
class TagSenders:
    """``Mailbox.sends_tag`` for ``me`` over the plans it knows (the one it trains, the newest it saw)."""

    me: str
    plans: tuple[PlanRecord, ...]

    @classmethod
    def of(cls, me: str, plans: Iterable[PlanRecord | None]) -> TagSenders:
        return cls(me, tuple(p for p in plans if p is not None))

    def __call__(self, sender: str, tag: Tag) -> str | None:
        problems = [sender_problem(p, self.me, sender, tag) for p in self.plans if p.epoch == tag.epoch]
        if not problems or None in problems:  # a plan we have not read yet, or one that names it
            return None
        return f"peer {sender} does not send {tag}: {problems[0]}"
