"""Who checks a plan by a search of its own, and when the other members may follow it on their word.

    chosen = checkers(plan.membership, plan.leader, run, config.plan.checkers)
    verdict = vouched(plan, progress, chosen)   # True, False (one names another plan), None (not yet)

A follower checks a leader's plan by planning the same records itself (``plan_check``): seconds at 16
devices, about 7 s at 64 on a quiet core. Every follower searching at once is what a run of many agents on one
machine cannot afford, nor the agents of one multi-GPU machine, which share its CPU: 16 agents on two cores,
the leader's search took 35–45 s among its 15 followers' searches of the same records, against 2 s alone; at
64 the searches would take minutes. So each plan has its **checkers**: the ``plan.checkers`` members other
than its leader whose hash of (run, leader, member) is lowest. They depend on the run and the leader alone
(and who is a member), never on what the leader plans, so a leader cannot pick them by the plan it signs.

A checker checks as every follower did. Any other member waits for every checker's progress record to say that
it trains this very plan (its epoch, its signer and its digest, ``ProgressRecord.plan``: a member says so as
it takes the plan up, ``epoch.run_epoch``), then follows it unchecked; one that has waited ``plan.time_budget_s``
since it first saw the plan, reads a checker naming another plan of that epoch and signer, or pings a checker
whose answer says it refused a plan of that epoch (``PeerStatus.refused``: at once, not a record read later),
checks the plan itself (``plan_check.PlanGate``). A bad plan thus passes a member unchecked only if every one of its checkers
colludes with its leader; a single honest checker that refuses it leaves the others to check it themselves.
``plan.checkers = 0`` makes every follower check, as a run of at most ``checkers + 1`` members always does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

from p2ptrain.net.dht.records import PlanRecord, ProgressRecord


def checkers(members: Collection[str], leader: str, run: str, count: int) -> frozenset[str]:
    """The members other than ``leader`` that check its plans (module docstring): all of them where ``count`` is 0
    or at least their number."""
    others = sorted(set(members) - {leader})
    if count <= 0 or len(others) <= count:
        return frozenset(others)

    def rank(member: str) -> bytes:
        return hashlib.blake2b(f"{run}|{leader}|{member}".encode(), digest_size=16).digest()

    return frozenset(sorted(others, key=rank)[:count])


def vouched(plan: PlanRecord, progress: Mapping[str, ProgressRecord], chosen: Collection[str]) -> bool | None:
    """Whether every one of ``chosen`` says it trains ``plan`` (True), one says it trains another plan of the same
    epoch and signer (False: the leader showed its checkers another plan), or not yet (None)."""
    digest, said = plan.digest(), 0
    for checker in chosen:
        record = progress.get(checker)
        if record is None or record.epoch != plan.epoch or record.leader != plan.leader or not record.plan:
            continue
        if record.plan != digest:
            return False
        said += 1
    return True if said == len(chosen) else None
