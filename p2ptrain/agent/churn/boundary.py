"""The step-boundary check of a training agent, run off the training thread.

At every step boundary an epoch asks whether a newer plan takes over (``Agent._should_halt``). Answering
means reading the run's records from the DHT — the plans every time, the peers and (for the leader) the
links and progress every ``poll_s`` — which took 70–140 ms a step on the training thread in the end-to-end
benchmark. A ``BoundaryWatch`` runs that check on a thread of its own while the epoch trains, one after
another with ``interval_s`` between them, and the training thread only reads its latest answer::

    with BoundaryWatch(agent_check, interval_s=INTERVAL_S) as watch:
        ...
        plan = watch.plan          # at a step boundary: never blocks

The pause between checks follows the steps: half the time between the last two boundaries that read an
answer, within ``interval_s`` … ``max_interval_s`` (each check reads the DHT, which costs the shared CPU
as much as the training it no longer blocks). A newer plan is thus seen within half a step and a DHT read of
its publication, as the synchronous read saw it at the next boundary after its publication; a re-plan point lies two steps ahead of
the progress the leader saw (``restart.join_start``) and a stage keeps its last two states, so a trainer that
sees it one step late still holds the state it starts from. That late trainer has started a step its peers,
stopped at the plan's start, will never finish with it: ``overshot`` says so, and the agent cuts the step
short at once (``Transport.abort_epoch``) instead of letting it wait for its call deadline — which also held
up the new epoch's first step past its peers' deadlines, so a join turned into a failed epoch. An error of
the check (a refused plan set, ``errors.AgentError``) is raised to the training thread at its next boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
INTERVAL_S = 0.2  # the shortest pause between two checks while training (at most ``membership.poll_s``)
MAX_INTERVAL_S = 1.0  # the longest (``membership.poll_s``'s default)


def overshot(start_step: int, training_epoch: int | None, plan_epoch: int, done: int | None) -> bool:
    """Whether a trainer of ``training_epoch`` that went on from its last boundary after ``done`` steps (None:
    it is halting, or has no step in flight) has started a step beyond the start of a newer plan (epoch
    ``plan_epoch``, from step ``start_step``): it holds that step's state already, and its peers stopped there."""
    return training_epoch is not None and done is not None and plan_epoch > training_epoch and start_step <= done


class BoundaryWatch(Generic[T]):
    """Runs ``check`` on a background thread until stopped; ``plan`` is its latest answer (None at first)."""

    def __init__(self, check: Callable[[], T | None], interval_s: float, *, max_interval_s: float = MAX_INTERVAL_S,
                 stop_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if not 0 < interval_s:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._check = check
        self._min_interval_s = interval_s
        self._max_interval_s = max(interval_s, max_interval_s)
        self.interval_s = interval_s  # the pause now (``plan`` adapts it to the steps)
        self._last_read_s: float | None = None
        self._clock = clock
        self._stop_timeout_s = stop_timeout_s
        self._stopped = threading.Event()
        self._latest: T | None = None
        self._error: BaseException | None = None
        self.checks = 0  # completed checks (for tests and logs)
        self._thread = threading.Thread(target=self._run, name="p2ptrain-boundary", daemon=True)

    @property
    def plan(self) -> T | None:
        """The latest check's answer; raises the error a check failed with, once."""
        now = self._clock()
        if self._last_read_s is not None:
            self.interval_s = min(self._max_interval_s, max(self._min_interval_s, (now - self._last_read_s) / 2))
        self._last_read_s = now
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._latest

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._latest = self._check()
            except Exception as e:  # handed to the training thread; the watch stops
                self._error = e
                return
            self.checks += 1
            self._stopped.wait(self.interval_s)

    def start(self) -> BoundaryWatch[T]:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the check in progress; the caller may then use the checked state alone."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._stop_timeout_s)
            if self._thread.is_alive():
                logger.warning("the step-boundary check did not finish within %.0f s of the epoch's end",
                               self._stop_timeout_s)

    def __enter__(self) -> BoundaryWatch[T]:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
