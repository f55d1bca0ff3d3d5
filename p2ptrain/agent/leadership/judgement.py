"""The leader's judgement: whom a failure is on, and who stays out of the next plans.

    judge = Judge(config, events, peer_id, run_id, fetch_evidence)
    judging = judge.judge_evidence(current, progress)   # evidence re-checked; None once every piece is judged
    progress = judge.without_cleared(progress)            # refusals whose evidence did not hold roll nothing back
    judge.quarantine_culprits(current, replan)            # a failure's causes (``churn.replan``) ...
    judge.own_finding(current, progress, absent)          # ... the leader's own finding ...
    judge.count_blames(current, replan)                   # ... and the blames of halted trainers, counted
    slowdowns = judge.judge_compute(current, membership)  # the compute each trainer showed (``leadership.claims``)

The leader (``leader.Leader``) owns one and calls it from the thread that leads (the agent's loop, or the
step-boundary thread while an epoch trains); its state is that thread's alone. Evidence comes two ways: a sum
check's signed statement (``verify.sum_check``), re-checked here at once, and a failed recompute's bulk,
redone beside the loop (``Disputes``). Evidence that holds quarantines the accused at once; evidence that
does not quarantines the blamer, and the blame is *cleared*: it counts against nobody and rolls nothing back.
Blames without evidence are counted (``churn.quarantine``): a peer is quarantined once blamed for
``churn.quarantine_blames`` epochs within ``churn.blame_window_s``; two peers that refused each other are a
dispute, counted by counterpart and kept apart in every later plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping

from p2ptrain.agent.churn.quarantine import Quarantine
from p2ptrain.agent.churn.replan import Replan
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.events import EventLog
from p2ptrain.agent.leadership.claims import ComputeWatch
from p2ptrain.agent.leadership.disputes import Disputes, Fetch
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.verify.attest import judge_evidence
from p2ptrain.verify.evidence import evidence_check, is_bulk_evidence

logger = logging.getLogger(__name__)


class Judge:
    """The leader's judgement of failures (module docstring): the quarantine, the evidence judged and cleared,
    the compute each trainer showed."""

    def __init__(self, config: AgentConfig, events: EventLog, peer_id: str, run_id: str,
                 fetch_evidence: Fetch | None = None):
        self.config = config
        self.events = events
        self.peer_id = peer_id
        self.run_id = run_id
        self.quarantine = Quarantine(config.churn.quarantine_s, config.churn.quarantine_max_s,
                                     blame_epochs=config.churn.quarantine_blames,
                                     blame_window_s=config.churn.blame_window_s)
        self._judged: set[tuple[str, int]] = set()  # (blamer, epoch) whose evidence was judged
        self._disputes = Disputes(config, run_id, fetch_evidence)  # failed recomputes' evidence, judged
        self._cleared: set[tuple[str, int]] = set()  # (peer, epoch) blamed with evidence that did not hold
        self._compute = ComputeWatch(config.claims.speed_tolerance, config.claims.min_steps)

    def close(self) -> None:
        """Stop the thread that redoes disputed recomputes; a judgement under way is dropped."""
        self._disputes.close()

    def observe(self, current: PlanRecord, progress: Mapping[str, ProgressRecord]) -> None:
        """The epoch's progress records: each trainer's compute, for ``judge_compute``."""
        self._compute.observe(current, progress)

    def without_cleared(self, progress: Mapping[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """``progress`` without the refusals whose evidence did not hold (``without_cleared``)."""
        return without_cleared(progress, self._cleared)

    def quarantine_culprits(self, current: PlanRecord, replan: Replan) -> None:
        """A failure's causes (``Replan.culprits``: who failed it, by the rule of ``churn.replan``), quarantined."""
        for peer in replan.culprits:
            if peer != self.peer_id and (backoff := self.quarantine.add(peer, current.epoch)) is not None:
                logger.warning("quarantining peer %s for %.0f s: it failed epoch %d (%s)", peer, backoff,
                               current.epoch, replan.reason)
                self.events.write("quarantined", peer=peer, epoch=current.epoch, seconds=backoff, reason=replan.reason)

    def _quarantined(self, peer: str, epoch: int, backoff: float, reason: str) -> None:
        logger.warning("quarantining peer %s for %.0f s: %s", peer, backoff, reason)
        self.events.write("quarantined", peer=peer, epoch=epoch, seconds=backoff, reason=reason)

    def judge_evidence(self, current: PlanRecord, progress: dict[str, ProgressRecord]) -> str | None:
        """Blames that come with evidence (``ProgressRecord.evidence``): a sum check's signed statement
        (``verify.sum_check``) re-checked here, a failed recompute's redone from the bulk its finder sends us
        (``Disputes``, beside the loop: while one is judged this says so and nothing is re-planned). Evidence
        that holds quarantines the blamed peer at once (an honest member fails a check with probability
        ``verify.false_alarm``); evidence that does not hold quarantines the blamer, and its blame is not counted
        against the peer it named: a liar blaming an honest peer is the one caught. A recompute the judge finds
        neither wrong nor clearly right (``verify.dispute``) is the finder's word, counted as any blame."""
        judging = []
        for blamer, record in sorted(progress.items()):
            if record.epoch != current.epoch or not record.halted or record.blame is None or not record.evidence:
                continue
            if (blamer, record.epoch) in self._judged or blamer not in current.membership:
                continue
            accused = record.blame
            if is_bulk_evidence(record.evidence):
                check = evidence_check(record.evidence)
                verdict = self._disputes.verdict(blamer, record, current)
                if verdict is None:
                    judging.append(f"judging {blamer}'s evidence against {accused}")
                    continue
                self._judged.add((blamer, record.epoch))
                if verdict.holds is None:
                    logger.warning("evidence from %s against %s is undecided (%s): its word, as any blame", blamer,
                                   accused, verdict.reason)
                    self.events.write("evidence", epoch=record.epoch, blamer=blamer, accused=accused, holds=None,
                                      reason=verdict.reason, check=check)
                    continue
                why = None if verdict.holds else verdict.reason
                proven = (f"its work failed the recompute check of epoch {record.epoch}: redone from its own signed "
                          f"commitment, whose messages and parameters {blamer} forwarded ({verdict.reason})"
                          if check == "recompute" else
                          f"its statement failed the {check} check of epoch {record.epoch}: proven by the message it "
                          f"accepted, under the step's signed commitments, which {blamer} forwarded ({verdict.reason})")
            else:
                self._judged.add((blamer, record.epoch))
                why = judge_evidence(record.evidence, accused, self.run_id, self.config.verify.false_alarm)
                proven = (f"its work failed the sum check of epoch {record.epoch}: proven by its own signed statement, "
                          f"which {blamer} forwarded")
                check = "sum"
            if why is None:
                culprit, reason = accused, proven
            else:
                culprit = blamer
                reason = f"it blamed {accused} for epoch {record.epoch} with evidence that does not hold: {why}"
                self._cleared.add((accused, record.epoch))
            logger.warning("evidence from %s against %s %s", blamer, accused, "holds" if why is None else
                           f"does not hold ({why})")
            self.events.write("evidence", epoch=record.epoch, blamer=blamer, accused=accused, holds=why is None,
                              reason=why or "", check=check)
            if culprit == self.peer_id:
                continue
            backoff = self.quarantine.add(culprit, record.epoch, proven=True)
            if backoff is not None:
                self._quarantined(culprit, record.epoch, backoff, reason)
        return "; ".join(judging) or None

    def own_finding(self, current: PlanRecord, progress: Mapping[str, ProgressRecord],
                     absent: Collection[str] = ()) -> None:
        """A member whose work failed a check of this leader's own (our halted record refused it), or that our
        own heartbeats saw stay away from the epoch past its time (``absent``: it never took up its stage, and
        halting with the others afterwards changes nothing): quarantined at once. Our own finding is no one's
        word to us; evidence, where the check has it, was judged already (``judge_evidence``). Followers do not
        count the accused's blame of us (``plan_check.culpable_leader``)."""
        for peer in sorted(set(absent) & set(current.membership) - {self.peer_id}):
            backoff = self.quarantine.add(peer, current.epoch)
            if backoff is not None:
                reason = (f"it never took up its stage of epoch {current.epoch}: its heartbeat answers said so past "
                          "its time (not there, or training and never sending; the leader's finding)")
                self._quarantined(peer, current.epoch, backoff, reason)
        own = progress.get(self.peer_id)
        if own is None or own.epoch != current.epoch or not own.halted or not own.refused or own.blame is None:
            return
        for accused in (own.blame, *own.also):  # every member our checks refused in that step
            if accused == self.peer_id or accused not in current.membership or (accused, current.epoch) in self._cleared:
                continue
            backoff = self.quarantine.add(accused, current.epoch, proven=True)
            if backoff is not None:
                reason = f"its work failed a check of the leader's own in epoch {current.epoch} (the leader's finding)"
                self._quarantined(accused, current.epoch, backoff, reason)

    def count_blames(self, current: PlanRecord, replan: Replan) -> None:
        """Members blamed for this failure that halted: quarantined once blamed for ``churn.quarantine_blames``
        epochs within ``churn.blame_window_s`` (``churn.quarantine``), else counted."""
        churn = self.config.churn
        counterpart = {p: q for pair in replan.disputes for p, q in (pair, pair[::-1])}
        self.quarantine.disputed(replan.disputes, current.epoch)  # all of them before any is counted
        for peer in replan.blamed:
            if peer == self.peer_id or (peer, current.epoch) in self._cleared:
                continue
            if peer in counterpart:  # word against word: counted by counterpart, the pair kept apart from now on
                self._count_dispute(current, peer, counterpart[peer])
                continue
            count = self.quarantine.blame(peer, current.epoch)
            if count is None:  # this epoch's failure read again
                continue
            if count < churn.quarantine_blames:
                logger.info("peer %s was blamed for epoch %d's failed calls (%d of %d epochs within %.0f s before "
                            "it is quarantined)", peer, current.epoch, count, churn.quarantine_blames,
                            churn.blame_window_s)
                self.events.write("blamed", peer=peer, epoch=current.epoch, count=count)
                continue
            backoff = self.quarantine.add(peer, current.epoch)
            if backoff is None:  # quarantined for this epoch's failure already
                continue
            reason = (f"blamed by a halted trainer for the failed calls of {count} epochs within "
                      f"{churn.blame_window_s:.0f} s (the last {current.epoch})")
            self._quarantined(peer, current.epoch, backoff, reason)

    def _count_dispute(self, current: PlanRecord, peer: str, other: str) -> None:
        """``peer`` and ``other`` refused each other without evidence in this epoch (``Quarantine.dispute``):
        ``peer`` is quarantined once it disputed with ``churn.quarantine_blames`` distinct peers and no smallest
        set of liars that explains every dispute leaves it out (``Quarantine.explained``), else counted."""
        churn = self.config.churn
        count = self.quarantine.dispute(peer, other, current.epoch)
        if count is None:
            return
        if count >= churn.quarantine_blames and self.quarantine.explained(peer):
            logger.warning("peer %s disputed with %d distinct peers without evidence, but other peers' disputes explain "
                           "its own (it is in no smallest set of liars that explains every dispute): kept apart, not "
                           "quarantined", peer, count)
            self.events.write("blamed", peer=peer, epoch=current.epoch, count=count, dispute=other, explained=True)
            return
        if count < churn.quarantine_blames:
            logger.info("peer %s and %s refused each other in epoch %d without evidence: kept apart from now on "
                        "(%s disputed with %d of the %d distinct peers before it is quarantined)", peer, other,
                        current.epoch, peer, count, churn.quarantine_blames)
            self.events.write("blamed", peer=peer, epoch=current.epoch, count=count, dispute=other)
            return
        backoff = self.quarantine.add(peer, current.epoch)
        if backoff is None:
            return
        reason = (f"it refused, and was refused by, {count} distinct peers without evidence within "
                  f"{churn.blame_window_s:.0f} s (the last {other}, epoch {current.epoch})")
        self._quarantined(peer, current.epoch, backoff, reason)

    def judge_compute(self, current: PlanRecord | None, membership: Membership) -> dict[str, float]:
        """Before a plan: what the epoch trained showed of each trainer's compute (``leadership.claims``); the
        factors the next plan prices the members with."""
        for s in self._compute.judge(current, membership.peers, self.config.train) if current is not None else ():
            if s.factor > 1.0:
                logger.warning("peer %s computed a step of epoch %d in %.3f s where its calibration predicts %.3f s "
                               "(%.1fx, beyond the %gx tolerated): planned %.1fx slower from now on", s.peer, s.epoch,
                               s.observed_s, s.predicted_s, s.factor, self.config.claims.speed_tolerance, s.factor)
            else:
                logger.info("peer %s computed as its calibration predicts again (epoch %d: %.3f s, predicted %.3f s); "
                            "its claim counts again", s.peer, s.epoch, s.observed_s, s.predicted_s)
            self.events.write("claim_corrected", peer=s.peer, epoch=s.epoch, factor=round(s.factor, 4),
                              observed_s=s.observed_s, predicted_s=s.predicted_s)
        return self._compute.slowdowns_of(membership.ids)


def without_cleared(progress: Mapping[str, ProgressRecord],
                    cleared: Collection[tuple[str, int]]) -> dict[str, ProgressRecord]:
    """``progress`` with each refusal whose evidence did not hold (``cleared``: (accused, epoch)) no refusal: it
    rolls nothing back (its accused's states stay sources), nor do the others its writer refused in that step
    (``also`` stands only with ``refused``, and a proven liar's word is spent)."""
    return {p: dataclasses.replace(r, refused=False, also=()) if r.refused and (r.blame, r.epoch) in cleared else r
            for p, r in progress.items()}
