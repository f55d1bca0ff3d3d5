"""Leader election and plan acceptance: pure functions over what an agent reads from the DHT.

The live peer with the lowest peer ID leads. "Lowest" is the smallest base58 string, the order of
hivemind's ``PeerID.__lt__``; every p2ptrain peer ID is a 46-character sha2-256 multihash (``Qm...``), so
this is also the numeric order of the digests. "Live" is the caller's choice (typically: has an unexpired,
verified peer record); a bootstrap peer publishes no peer record and so never leads.

An agent follows a plan only if it is signed by the peer it also sees as lowest *and* was made for exactly
the membership it sees; anything else is ignored with a log line (a plan by another peer is a warning, the
leader's plan for an older membership is normal churn and only informational).

Note: lowest-ID election is not Sybil-resistant: anyone may generate keys until one sorts first. Closed
runs admit only listed peers or holders of a join token (``dht.admission``); in any run, followers check a
plan before following it and pass over a leader that publishes none they accept (``leadership.plan_check``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping

from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.identity import peer_id_to_bytes

logger = logging.getLogger(__name__)


def sorted_membership(peer_ids: Iterable[str]) -> tuple[str, ...]:
    """Peer IDs in election order (lowest first), without repeats."""
    return tuple(sorted(set(peer_ids)))


def leader_of(peer_ids: Iterable[str]) -> str | None:
    """The lowest peer ID, or None for an empty membership."""
    return min(peer_ids, default=None)


def membership_digest(peer_ids: Iterable[str]) -> str:
    """A short hex digest naming a membership (sorted, de-duplicated), for logs and comparisons."""
    h = hashlib.sha256()
    for peer_id in sorted_membership(peer_ids):
        h.update(peer_id_to_bytes(peer_id))
    return h.hexdigest()[:16]


def select_plan(plans: Mapping[str, PlanRecord], live_peers: Iterable[str]) -> PlanRecord | None:
    """The plan to follow, from verified plans keyed by signer (``SwarmDHT.read_plans()``), or None.

    Accepted only if signed by the lowest of ``live_peers`` and made for exactly that membership.
    """
    members = sorted_membership(live_peers)
    leader = members[0] if members else None
    chosen = None
    for signer, plan in plans.items():
        if signer != leader:
            logger.warning(
                "ignoring plan epoch %d signed by %s: the leader (lowest live peer) is %s",
                plan.epoch,
                signer,
                leader,
            )
        elif plan.membership != members:
            logger.info(
                "leader %s's plan epoch %d is for membership %s (%d peers), live membership is %s (%d peers): "
                "waiting for a new plan", signer, plan.epoch, membership_digest(plan.membership),
                len(plan.membership), membership_digest(members), len(members),
            )
        else:
            chosen = plan
    return chosen


def latest_plan(
    plans: Mapping[str, PlanRecord], live_peers: Iterable[str], me: str, after_epoch: int, log: bool = False,
    leader: str | None = None,
) -> PlanRecord | None:
    """The plan to follow under churn: the highest epoch above ``after_epoch`` signed by the lowest live peer
    and naming ``me`` as a member, or None. Epochs decide: a plan of an older epoch (a leader that died or
    came back late) is never followed again, and a new leader numbers its plans above every plan it has
    seen, so a swarm never splits over two plans. The plan's membership need not equal the live view: views
    differ for a moment while records expire, and the plan itself says who trains and who idles.
    With ``log``, every plan signed by another peer is reported as ignored. ``leader``: who leads among
    ``live_peers`` (``leadership.standing``); by default the lowest.
    """
    live = set(live_peers)
    leader = leader if leader is not None and leader in live else leader_of(live)
    if log:
        for signer, plan in plans.items():
            if signer != leader:
                (logger.warning if signer in live else logger.info)(
                    "ignoring plan epoch %d signed by %s: the leader (lowest live peer in standing) is %s", plan.epoch, signer,
                    leader)
    plan = plans.get(leader) if leader is not None else None
    if plan is None or plan.epoch <= after_epoch or me not in plan.membership:
        return None
    return plan


def finished_without(
    plans: Iterable[PlanRecord | None], me: str, followed: int, progress: Callable[[], Mapping[str, ProgressRecord]],
    steps: int, followed_leader: str | None = None,
) -> PlanRecord | None:
    """The first of ``plans`` newer than the plan ``me`` followed last (``followed``: its epoch, -1: none;
    ``followed_leader``: its signer) that leaves ``me`` out and is done: each of its trainers says in its own
    progress record (``progress()``, read only if a plan leaves ``me`` out) that it trained step ``steps`` in
    that plan's epoch, under that plan's signer where the record names one. A plan by another signer than
    ``followed_leader`` counts whatever its epoch: the peers that passed ``me`` over while it led numbered their
    plans from what they had seen, not from ``me``'s (a run finishes once, so its trainers' final records say
    which plan finished it). The plan's signer need not be live: once a run finished its peers leave, and an agent cut
    off until then finds only their records (a leader's plan outlives it by its record's lifetime, the peers'
    progress by theirs)."""
    records: Mapping[str, ProgressRecord] | None = None
    for plan in plans:
        if plan is None or me in plan.membership:
            continue
        if plan.epoch <= followed and (followed_leader is None or plan.leader == followed_leader):
            continue
        records = progress() if records is None else records
        trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)}
        if all(p in records and records[p].epoch == plan.epoch and records[p].step >= steps
               and records[p].leader in (None, plan.leader) for p in trainers):
            return plan
    return None
