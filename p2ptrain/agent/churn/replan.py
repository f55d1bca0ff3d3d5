"""When the leader re-plans, for whom, and from which step: ``ReplanWatch`` (no I/O; the clock is an argument).

Given the plan being trained (epoch e), the live peers and the heartbeats it read, the leader re-plans when

* **a trainer halted** (a call failed): a trainer that dies makes every other trainer halt within the
  call deadline, since no step completes without every trainer, so a halt is the failure signal (a peer
  record that lapses for a moment while its agent trains on is not). The watch then waits until every
  live trainer of epoch e has halted, or ``halt_timeout_s`` passed (those that did not halt are left out);
  dead trainers (their peer records expired) are not waited for. A trainer a halted peer blamed gets
  only ``BLAMED_HALT_S`` from that blame to halt (re-planning never waits on a culprit's cooperation; an
  earlier halt that blamed nobody does not shorten it, nor ever past ``halt_timeout_s``), unless its answer to
  the leader's heartbeat pings (``liveness``) already says it halted the epoch: then only its halted record
  is on its way (a DHT store under load can take seconds) and it gets ``halt_timeout_s`` like any trainer.
  A trainer the leader's own heartbeats saw stay away from the epoch (it never took it up: ``absent``) is not
  waited for at all: it has nothing of the epoch to halt. Those left out are the failure's culprits
  (quarantined), unless they are more than half the trainers: honest peers being the many, the failure is
  then the run's (an overloaded machine), and they stay members.
  The new epoch starts at ``restart.restart_point`` over what the halted trainers keep and the complete
  checkpoints; every live peer but those left out is a member.
* **a spare keeping warm copies left**: training goes on; the next epoch (with other backup peers) starts
  at a re-plan point as for joiners.
* **peers joined** (live, not members of epoch e): once ``join_min_new_peers`` wait, or
  ``join_every_steps`` steps passed since the first did. Training goes on meanwhile; the plan starts at
  ``restart.join_start`` of the progress seen when it is published, with each stage's state from its
  lowest-replica live trainer of epoch e.

Nothing is re-planned once every trainer of epoch e finished.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from p2ptrain.agent.churn.restart import Holding, Restart, copies_of, holding_of, join_start, restart_point
from p2ptrain.agent.config import ChurnConfig
from p2ptrain.model.outer import EVERY_STEP, Rounds
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.transport.status import FAIL, HALT, PeerStatus

FAILURE = "failure"
BLAMED_HALT_S = 10.0  # how long a trainer blamed for a failed call gets to halt (heartbeats: ~2 rounds of 6 s)
JOIN = "join"


@dataclass(frozen=True)
class Replan:
    kind: str  # FAILURE or JOIN
    members: tuple[str, ...]  # the next plan's members (sorted)
    reason: str
    restart: Restart | None = None  # a failure's restart point (a join's is fixed when it is published)
    # a failure's likely causes: trainers that died or did not halt in time (a trainer a halted peer blamed,
    # ``ProgressRecord.blame``, gets less time); the leader quarantines them (``churn.quarantine``)
    culprits: tuple[str, ...] = ()
    # members a halted trainer blamed for its failed call that halted too, at the root of the blames
    # (``blame_roots``): no culprits, but the leader counts the epochs each is blamed for (``Quarantine.blame``)
    blamed: tuple[str, ...] = ()
    # pairs of halted members that refused each other (word against word, ``disputes_of``): among ``blamed``, but
    # the leader counts each one's distinct counterparts, and keeps the pair apart in its plans
    disputes: tuple[tuple[str, str], ...] = ()


class ReplanWatch:
    """The leader's view of the epoch being trained; ``check`` says when and how to re-plan."""

    def __init__(self, churn: ChurnConfig, rounds: Rounds = EVERY_STEP):
        self.churn = churn
        self.rounds = rounds  # where committed states lie (DiLoCo: rounds' ends), ``model.outer.Rounds``
        self.note = ""  # what the watch waits for (for the log)
        self._failure_since: float | None = None
        self._joiners_since_step: int | None = None
        # halted heartbeats seen for the epoch being watched: a halt is final, so one missing from a later
        # read (a DHT read under load may miss records) still counts, and the wait for the rest goes on
        self._halted: dict[str, ProgressRecord] = {}
        self._epoch: int | None = None
        self._blamed_since: dict[str, float] = {}  # when a halted trainer's blame of each peer was first read

    def reset(self) -> None:
        self._failure_since = self._joiners_since_step = None
        self._halted, self._epoch, self._blamed_since = {}, None, {}
        self.note = ""

    def check(
        self, plan: PlanRecord, live: Iterable[str], progress: Mapping[str, ProgressRecord], steps: int,
        checkpoints: Iterable[int], now: float, done: int | None = None,
        statuses: Mapping[str, PeerStatus] | None = None, absent: Collection[str] = (),
    ) -> Replan | None:
        """``statuses``: the leader's last heartbeat answer from each peer (``LivenessMonitor.statuses``);
        ``absent``: trainers the leader's own heartbeats saw stay away from the epoch past their time (they
        never took it up: nothing of theirs to wait for)."""
        live = set(live)
        trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)}
        ours = {p: r for p, r in progress.items() if r.epoch == plan.epoch}
        if all(p in ours and ours[p].step >= steps for p in trainers):
            return None
        if self._epoch != plan.epoch:
            self._halted, self._epoch, self._failure_since, self._blamed_since = {}, plan.epoch, None, {}
        self._halted.update({p: r for p, r in ours.items() if r.halted})
        halted = {p: r for p, r in self._halted.items() if p in live}  # spares say what they keep too
        dead = sorted(trainers - live)
        if set(halted) & trainers:
            finished = {p: r for p, r in ours.items() if p in trainers & live and not r.halted and r.step >= steps}
            said = {p for p, s in (statuses or {}).items() if s.epoch == plan.epoch and s.state in (FAIL, HALT)}
            return self._failure(plan, live, trainers, dead, halted, finished, checkpoints, now, said, set(absent))
        self._failure_since, self._blamed_since = None, {}
        # the epoch's start is progress its trainers hold before any of them says so (``restart.join_start``)
        furthest = max([r.step for r in ours.values()] + ([done] if done is not None else []) + [plan.start_step])
        if join_start([furthest], rounds=self.rounds) >= steps:
            return None  # a re-plan point (``restart.join_start``) would come at or after the last step
        keepers = {plan.backup_of(j) for j in range(plan.stages)} - {None}
        lost_keepers = sorted(keepers - live - trainers)
        if lost_keepers:  # training goes on, but a stage has one copy fewer: re-plan at the next point
            return Replan(JOIN, tuple(sorted(live)), f"peer(s) {', '.join(lost_keepers)} keeping warm copies left")
        joiners = sorted(live - set(plan.membership))
        if not joiners:
            self._joiners_since_step = None
            return None
        if self._joiners_since_step is None:
            self._joiners_since_step = furthest
        every = self.churn.join_every_steps
        if len(joiners) >= self.churn.join_min_new_peers or (every and furthest - self._joiners_since_step >= every):
            return Replan(JOIN, tuple(sorted(live)), f"{len(joiners)} peer(s) joined: {', '.join(joiners)}")
        self.note = f"{len(joiners)} peer(s) wait to join (re-plan at {self.churn.join_min_new_peers})"
        return None

    def _failure(self, plan: PlanRecord, live: set[str], trainers: set[str], dead: list[str],
                 halted: Mapping[str, ProgressRecord], finished: Mapping[str, ProgressRecord],
                 checkpoints: Iterable[int], now: float, said: set[str],
                 absent: set[str] = frozenset()) -> Replan | None:
        """Trainers that finished every step before the failure wait for their peers' last heartbeats and
        take up the next plan from there: they count as holders of their last steps, not as waited for.
        ``said``: peers whose heartbeat answer says they halted this epoch (their records may be late)."""
        if self._failure_since is None:
            self._failure_since = now
        # A trainer a halted peer blames gets only BLAMED_HALT_S from that blame to halt too (an honest one,
        # stuck behind the failure like its blamer, halts within a heartbeat round): re-planning never waits
        # on a culprit's cooperation. Counted from the blame, not from the failure's first halt: a halt that
        # came early (a peer that halted at once, blaming nobody) must not shorten the cascade's last blamed
        # peer's time to nothing. One that halted is no culprit: timeouts cascade, so blame alone proves
        # nothing; nor is one whose heartbeat answer says it halted (its halted record may cross a busy DHT
        # more slowly than BLAMED_HALT_S): it gets halt_timeout_s like any trainer.
        blamed = {r.blame for r in halted.values() if r.blame in plan.membership} - said
        for peer in blamed:
            self._blamed_since.setdefault(peer, now)
        waiting = (trainers & live) - set(halted) - set(finished)
        full = self._failure_since + self.churn.halt_timeout_s
        short_s = min(self.churn.halt_timeout_s, BLAMED_HALT_S)
        deadlines = [now if p in absent else min(full, self._blamed_since[p] + short_s) if p in blamed else full
                     for p in waiting]
        if waiting and now < max(deadlines):
            self.note = f"re-planning epoch {plan.epoch}: waiting for {len(waiting)} trainer(s) to halt"
            return None
        holdings: dict[str, list[Holding]] = {}
        for peer, record in [*halted.items(), *finished.items()]:
            kept = record.kept if record.halted else self.churn.keep_states
            holding = holding_of(plan, peer, record.step, kept, record.stage if record.halted else None, self.rounds)
            holdings[peer] = ([holding] if holding is not None else []) + copies_of(record.holds)
        cap = refused_cap(halted)  # a checkpoint after a refused step may hold what it tainted, like a copy
        checkpoints = [c for c in checkpoints if cap is None or c <= cap]
        restart = restart_point(plan.stages, refused_states(holdings, halted), checkpoints, self.rounds)
        why = f"peer(s) {', '.join(dead)} left" if dead else f"a step failed on {len(halted)} trainer(s)"
        if restart.lost_stages:
            why += f"; every replica of stage(s) {', '.join(map(str, restart.lost_stages))} was lost"
        if restart.from_copy:
            why += f"; stage(s) {', '.join(map(str, restart.from_copy))} from warm copies of step {restart.step}"
        if restart.from_checkpoint:
            why += f"; resuming from the checkpoint of step {restart.step}"
        if waiting:
            why += (f"; left out (did not halt within {self.churn.halt_timeout_s:.0f} s, or {short_s:.0f} s once "
                    f"blamed): {', '.join(sorted(waiting))}")
        if waiting & blamed:
            why += f"; blamed by a halted trainer: {', '.join(sorted(waiting & blamed))}"
        if waiting & absent:
            why += f"; never took up the epoch (the leader's heartbeats): {', '.join(sorted(waiting & absent))}"
        if waiting & said:
            why += f"; halted by their heartbeats, but no halted record came: {', '.join(sorted(waiting & said))}"
        if len(waiting) * 2 > len(trainers):
            # honest peers are the many (docs/trust.md): most of the epoch's trainers cannot all be at fault; the
            # run was (a machine or network too loaded for them to take the epoch up: 59 of 64 agents on two
            # cores checked the plan themselves for minutes). They stay members, none of them a culprit.
            why += "; too many not halted to be at fault (more than half the trainers): kept, none quarantined"
            waiting = set()
        culprits = tuple(sorted(set(dead) | waiting))
        edges = {p: r.blame for p, r in halted.items() if r.blame in plan.membership and r.blame != p}
        accused = tuple(sorted(blame_roots(edges, refusals_of(halted)) - set(culprits)))
        return Replan(FAILURE, tuple(sorted(live - waiting)), why, restart, culprits, accused,
                      disputes_of(halted, set(accused)))


def disputes_of(halted: Mapping[str, ProgressRecord], among: Collection[str]) -> tuple[tuple[str, str], ...]:
    """The pairs of ``among`` whose halted records refuse each other (``ProgressRecord.refused``, blame or
    ``also``) without evidence: word against word, one of the two lies (or its wire does) and nobody can say
    which. Each pair sorted; evidence is judged apart (``Judge.judge_evidence``)."""
    names = {p: {r.blame, *r.also} for p, r in halted.items() if r.refused and r.blame is not None and not r.evidence}
    return tuple(sorted({tuple(sorted((p, q))) for p, named in names.items() for q in named
                         if p in among and q in among and p in names.get(q, ())}))


def refusals_of(halted: Mapping[str, ProgressRecord]) -> set[str]:
    """The halted peers whose blame is a refusal: a check their blamed peer's work failed (``blame_roots``)."""
    return {p for p, r in halted.items() if r.refused and r.blame is not None}


def refused_states(holdings: Mapping[str, list[Holding]],
                   halted: Mapping[str, ProgressRecord]) -> dict[str, list[Holding]]:
    """``holdings`` without what a refused step may have tainted (``ProgressRecord.refused``): a peer whose work
    failed a check holds no source, and nobody's state after the earliest refused step is one (a stage that
    computed on a corrupt message passed its own checks and applied it; verification.md)."""
    refused = [r for r in halted.values() if r.refused and r.blame is not None]
    if not refused:
        return dict(holdings)
    cap, culprits = refused_cap(halted), {p for r in refused for p in (r.blame, *r.also)}
    return {p: [replace(h, last=min(h.last, cap)) for h in hs if h.first <= cap]
            for p, hs in holdings.items() if p not in culprits}


def refused_cap(halted: Mapping[str, ProgressRecord]) -> int | None:
    """The last state a re-plan may restart from after refused steps: the earliest refused record's (its
    finder reports the state before the step that failed); None: nothing refused."""
    return min((r.step for r in halted.values() if r.refused and r.blame is not None), default=None)


def blame_roots(edges: Mapping[str, str], refusals: Collection[str] = ()) -> set[str]:
    """Where the blames of a failed epoch end (``edges``: halted peer -> the peer it blamed; ``refusals``: the
    halted peers whose blame is a check their blamed peer's work failed, ``ProgressRecord.refused``).

    A halted peer whose call failed was stuck waiting on the peer it blames, a victim of the cascade: the
    failure is at the end of the chain, the blamed peer that blamed nobody. A refusal is no victim's blame:
    it is a cause, so the peer it names is a root, and a chain of failed calls that reaches a refuser ends
    there (the refuser halted on what it found: the calls to it failed because of it). So a member caught by a
    check, whose calls to its finder then fail, cannot turn the blame on its finder. A chain of failed calls
    that comes back on itself has no end: every peer on the loop counts; so does each side of two refusals
    of each other (word against word, ``docs/trust.md``)."""
    roots = {edges[p] for p in refusals if p in edges}
    for start in set(edges.values()):
        chain, peer = [], start
        while peer in edges and peer not in refusals and peer not in chain:
            chain.append(peer)
            peer = edges[peer]
        if peer in chain:
            roots.update(chain[chain.index(peer):])
        elif peer not in edges:
            roots.add(peer)
    return roots
