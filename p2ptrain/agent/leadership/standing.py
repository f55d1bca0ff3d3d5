"""Who may lead: the lowest live peer *in standing*, once the run has a history. Pure (no I/O).

Lowest-ID election alone lets a fresh key sort its way to the front at once. So once an epoch of the run
has made progress, only peers that have shown training work may lead:

* an epoch *made progress* when more than half of its trainers say, each in its own signed progress record,
  that they trained a step of it (a step past the plan's start) under the plan's signer. Trainers are
  coupled (pipelines and replica groups), so honest trainers move only if every stage computed: a peer that
  never computes cannot make its neighbours' records move, one peer's record cannot stand for the others',
  and a copy of the run's plan signed by another peer is trained by nobody;
* a peer is *in standing* once it trained an epoch that made progress, or signed its plan (the swarm
  checked that plan and trained it);
* before any epoch made progress (the run's first plan: nobody has history) every live peer is in standing,
  and the lowest leads, checked by its followers (``plan_check``);
* a leader passed over (silent, refused, culpable) falls out of standing, and owes epochs before it may lead
  again: ``2**(k-1)`` epochs that made progress with it as a trainer, after the one it was passed over in,
  for its k-th pass-over. The back-off thus follows the run, not only the clock: a rogue that comes back
  after its back-off cannot stall each later re-plan, however rare re-plans are.

A member in an open *dispute* (``churn.quarantine``: it and another refused each other without evidence,
so one of the two lies) leads only where no other peer in standing is live: a plan an agent trusts names the
pairs it keeps apart (``PlanRecord.apart``), and every member of a pair but that plan's signer waits until it
trained an epoch that made progress under a plan that names it in no pair (a rogue quarantined out of the
plans trains none, and waits). A rogue that disputed with an honest peer would otherwise take the run over when the honest leader is
passed over (under load, or blamed by the rogue's own failed calls), and quarantine its counterpart on its own
finding as leader (the campaign's ``clean_commit``, found at a colluding member and at a spare).

If no live peer is in standing (they all left), the lowest live peer that owes nothing leads, then the
lowest live peer: the run goes on. Each agent keeps its own standing from the plans and progress records
it reads. Only the plans it followed and plans signed by a peer in standing count: a group of keys that
signs a plan among themselves and publishes progress records of it earns nothing with an agent that
trains the run. A joiner, which followed nothing yet, learns the present epoch's trainers and signer
provisionally at its first reads, and keeps only what its own followed plans show once one moved; views
differ only about peers that neither trained nor signed the epoch being trained.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from p2ptrain.net.dht.records import PlanRecord, ProgressRecord


def moved(plan: PlanRecord, progress: Mapping[str, ProgressRecord]) -> list[str]:
    """The trainers of ``plan`` that say they trained a step of it: past its start, in its epoch, under its
    signer (``ProgressRecord.leader``: a copy of the plan signed by someone else is vouched for by nobody)."""
    trainers = {plan.peer_at(i, j) for i in range(plan.replicas) for j in range(plan.stages)}
    return sorted(p for p in trainers if (r := progress.get(p)) is not None and r.epoch == plan.epoch
                  and r.leader == plan.leader and r.step > plan.start_step)


def made_progress(plan: PlanRecord, progress: Mapping[str, ProgressRecord]) -> bool:
    """Whether more than half of ``plan``'s trainers say they trained a step of its epoch."""
    return 2 * len(moved(plan, progress)) > plan.stages * plan.replicas


@dataclass
class Standing:
    """One agent's record of who has shown training work in this run, and what passed-over leaders owe."""

    _worked: dict[str, set[int]] = field(default_factory=dict)  # peer -> epochs of progress it trained or signed
    _provisional: dict[str, set[int]] = field(default_factory=dict)  # the same, read before we trusted a plan
    _owed: dict[str, tuple[int, int]] = field(default_factory=dict)  # peer -> (passed over after epoch, epochs owed)
    _newest: int = -1  # the newest epoch observed (a pass-over counts the epochs after it)
    _apart: tuple[int, str, frozenset[frozenset[str]]] = (-1, "", frozenset())  # newest trusted plan: epoch,
    # signer, the pairs it keeps apart
    _named: dict[str, int] = field(default_factory=dict)  # peer -> newest trusted plan naming it in a pair
    _calm: dict[str, int] = field(default_factory=dict)  # peer -> newest epoch of progress it trained, not named
    history: bool = False  # an epoch of the run made progress (as far as we have read)

    def observe(self, plans: Iterable[PlanRecord | None], progress: Mapping[str, ProgressRecord],
                followed: Iterable[PlanRecord | None] = ()) -> None:
        """Read ``plans`` (any signers; None skipped) and the plans we ``followed`` against the progress records.

        What counts: the plans we followed, and plans signed by a peer in standing. Any other plan (a group of
        keys can sign a plan among themselves and publish progress records of it) counts only provisionally,
        while we have followed no plan that made progress: a joiner learns the run's leader from it, and
        forgets it once a plan it followed moved."""
        followed = [p for p in followed if p is not None]
        for plan in (*followed, *(p for p in plans if p is not None)):
            self._newest = max(self._newest, plan.epoch)
            trusted = plan in followed or plan.leader in self._worked
            named = disputants(plan)
            if trusted:
                if plan.epoch > self._apart[0]:
                    self._apart = (plan.epoch, plan.leader, plan.kept_apart)
                for peer in named:
                    self._named[peer] = max(self._named.get(peer, -1), plan.epoch)
            if not made_progress(plan, progress):
                continue
            if not trusted and self._worked:
                continue  # another group's plan: our history is our own now
            book = self._worked if trusted else self._provisional
            for peer in (*moved(plan, progress), plan.leader):
                book.setdefault(peer, set()).add(plan.epoch)
                if trusted and peer not in named:
                    self._calm[peer] = max(self._calm.get(peer, -1), plan.epoch)
            if trusted:
                self._provisional.clear()
        self.history = bool(self._worked or self._provisional)

    def moved_on(self, plan: PlanRecord, progress: Mapping[str, ProgressRecord]) -> bool:
        """Whether the run's own trainers train ``plan``: more than half of its trainers say they trained a step of
        it under its signer, and each of those trained an epoch we trust (a group of fresh keys signing a plan
        among themselves never counts once we have a history; before, what a joiner learns provisionally). An
        agent that leads in its own view and sees this, while nobody trains its own plan, was passed over by the
        run (``Following._step_aside``)."""
        book = self._worked or self._provisional  # before any own history, what a joiner would trust
        known = [p for p in moved(plan, progress) if p in book]
        return 2 * len(known) > plan.stages * plan.replicas

    def passed_over(self, peer: str, times: int) -> None:
        """``peer`` was passed over as leader for the ``times``-th time: it owes ``2**(times-1)`` epochs of
        progress trained after the newest epoch seen now."""
        self._owed[peer] = (self._newest, 2 ** max(0, times - 1))

    def owes(self, peer: str) -> int:
        """How many epochs of progress ``peer`` still owes before it may lead again (0: none)."""
        if peer not in self._owed:
            return 0
        after, count = self._owed[peer]
        return max(0, count - sum(1 for e in self._worked.get(peer, ()) if e > after))  # trusted epochs only

    def in_standing(self, peer: str) -> bool:
        if self.owes(peer):
            return False
        if peer in self._owed:  # it paid what it owed by training
            return True
        return not self.history or peer in self._worked or peer in self._provisional

    def proven(self, peer: str) -> bool:
        """Whether ``peer`` has shown training work (or the run has no history yet): a peer that has not is *on
        probation*, never a stage's only kind of trainer (``plan_maker.with_company``). A passed-over leader's
        training record stands: being passed over says nothing about its compute."""
        return not self.history or peer in self._worked or peer in self._provisional

    @property
    def kept_apart(self) -> tuple[str, frozenset[frozenset[str]]]:
        """The newest trusted plan's signer and the pairs it keeps apart (``PlanRecord.kept_apart``)."""
        return self._apart[1], self._apart[2]

    @property
    def disputed(self) -> frozenset[str]:
        """The peers a trusted plan named in a pair it keeps apart (its signer aside) that trained no epoch of
        progress since under a plan that did not: they wait to lead. A rogue quarantined out of the plans stays
        disputed (it trains nothing); its honest counterpart is calm again one epoch after its pairs expired."""
        return frozenset(p for p, epoch in self._named.items() if epoch > self._calm.get(p, -1))

    def leader(self, live: Collection[str]) -> str | None:
        """The peer that leads among ``live``: the lowest in standing and in no open dispute (``disputed``);
        else the lowest in standing; else the lowest that owes nothing; else the lowest (None for nobody)."""
        disputed = self.disputed

        def calm(peer: str) -> bool:
            return self.in_standing(peer) and peer not in disputed

        for eligible in (calm, self.in_standing, lambda p: not self.owes(p), lambda p: True):
            found = min((p for p in live if eligible(p)), default=None)
            if found is not None:
                return found
        return None


def disputants(plan: PlanRecord) -> frozenset[str]:
    """The members ``plan`` names in the pairs it keeps apart (``PlanRecord.kept_apart``), less its signer."""
    return frozenset(p for pair in plan.kept_apart for p in pair) - {plan.leader}


def followed_instead(me: str, ours: Iterable[PlanRecord | None], plans: Mapping[str, PlanRecord], live: Collection[str],
                     progress: Mapping[str, ProgressRecord], standing: Standing) -> PlanRecord | None:
    """The plan the run's own trainers train instead of ours (``ours``: the plans ``me`` signed and follows or
    published), or None: nobody trains ours (``made_progress``, whatever the epochs' numbers: a peer that took
    over numbered its plans from what it saw) while another live signer's plan is trained by trainers
    ``standing`` knows (``Standing.moved_on``). A leader that sees this was passed over by the run."""
    if any(p is not None and p.leader == me and made_progress(p, progress) for p in ours):
        return None
    for signer, plan in sorted(plans.items()):
        if signer != me and signer in live and standing.moved_on(plan, progress):
            return plan
    return None
