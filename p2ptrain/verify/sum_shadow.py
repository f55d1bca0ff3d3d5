"""The sum check of each step in the shadow of the next one: its rounds and sketches beside that step's compute.

    shadow = ShadowSums(checker, group, part, last_step)      # checker: a ``sum_check.SumChecker``
    trainer.link_wrapper = shadow.wrap                        # (the agent chains the recompute check's after it)
    reducer.verifier = shadow                                 # the step's hook, before its update

In its own hook (``SumChecker`` alone) a step waits for the sum check's two rounds across its group (commitments,
then statements: two round trips of the slowest link, every step, on a world-wide network a fair part of the step)
and its sketches. Here the hook of step t only sets the step's records aside (``allreduce.ReduceRecord``: nothing in
them changes once recorded, and the messages they hold live as long as they do); the check of step t runs on a
thread of its own during step t + 1, over step t + 1's link (``wrap``; its messages in the part ``part``, apart
from any step's own), and step t + 1's hook waits for it before that step's update, raising its failure there (the
finding names step t). Step t was applied: ``unverified`` names it until its check passes, and the re-plan
restarts from the state before it (``agent.epoch``: as for the recompute check's shadow, whose depth of kept
states this shares). The last step (``last_step``) is checked in its own hook.

What a member does in the check, and what it proves, is the ``SumChecker``'s unchanged: only when it runs moves.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from p2ptrain.futures import in_thread
from p2ptrain.runtime.allreduce import GroupExchange, ReduceRecord
from p2ptrain.runtime.link import GroupOverLink
from p2ptrain.verify.sum_check import SumChecker


class ShadowSums:
    """A ``SumChecker`` run one step late (see the module); ``seconds`` is the time the steps' hooks spent on it
    (waiting for the step before's check, or the last step's own), ``cpu_seconds`` and ``checked_steps`` the
    checker's wherever it ran."""

    def __init__(self, checker: SumChecker, group: tuple[str, ...], part: int, last_step: int):
        self.checker, self.group, self.part, self.last_step = checker, tuple(group), part, last_step
        self.epoch = self.step = 0
        self.seconds = 0.0
        self._pending: tuple[int, list[ReduceRecord], int, int] | None = None  # (step, records, rank, n)
        self._running: Future | None = None
        self.unverified: int | None = None  # the step applied whose check has not passed yet

    @property
    def cpu_seconds(self) -> float:
        return self.checker.cpu_seconds

    @property
    def checked_steps(self) -> int:
        return self.checker.checked_steps

    def begin_step(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    def wrap(self, link):
        """At a step's start, with its link: the step before's check begins, over it."""
        if self._pending is not None:
            (step, records, rank, n), self._pending = self._pending, None
            exchange, epoch = GroupOverLink(link, self.group, self.part), self.epoch
            self._running = in_thread(lambda: self._check(epoch, step, records, rank, n, exchange),
                                       f"sum-check-{step}")
        return link

    def __call__(self, records: list[ReduceRecord], rank: int, n: int, exchange: GroupExchange) -> None:
        """The step's hook, before its update: the step before's check ends (its failure is raised here, so this
        step is not applied); this step's is set aside for the next step, or done now if it is the last."""
        started = time.perf_counter()
        try:
            if self._running is not None:
                running, self._running = self._running, None
                running.result()  # its calls have their deadlines
                self.unverified = None
            if self.step >= self.last_step:
                self._check(self.epoch, self.step, records, rank, n, exchange)
            else:
                self._pending, self.unverified = (self.step, records, rank, n), self.step
        finally:
            self.seconds += time.perf_counter() - started

    def _check(self, epoch: int, step: int, records: list[ReduceRecord], rank: int, n: int,
               exchange: GroupExchange) -> None:
        self.checker.begin_step(epoch, step)
        self.checker(records, rank, n, exchange)
