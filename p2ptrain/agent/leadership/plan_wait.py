"""How long an agent has waited for the run's first plan since the run last moved toward one: what
``membership.plan_timeout_s`` bounds.

    wait = PlanWait(started)
    waited_s = wait.observe(live, statuses, own_search, max_epoch, planning)  # every poll, before any plan

The run moves toward its first plan while its live membership changes (peers join or leave), a newer plan is
read, we lead and our planner runs, or a search of the first plan runs: our own, or a pinged peer's, as its
ping answers say (``PeerStatus.search``, the whole seconds it has run: a plan's checkers search when it falls
due). An agent gives up after ``plan_timeout_s`` of none of these, so a run that cannot plan (too few peers
for its stages, a leader that never plans) ends with one line, and a slow one is not cut short while it
works: on two cores, 64 agents' first search took five minutes and their 960 s from the start ran out
seconds before the plan came. A peer whose answers claim a search that never ends can keep us waiting (not
training anything); the leader watch passes a late leader over all the same (``watching``).

Owned by the agent's main thread (its loop): no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

from p2ptrain.net.transport.status import PeerStatus


class PlanWait:
    def __init__(self, started: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.moved_at = started  # when the run last moved toward its first plan
        self.why = "the agent started"  # what it was
        self._live: frozenset[str] | None = None
        self._searches: dict[str, int] = {}  # each peer's (and our own, ``""``) last said search seconds
        self._epoch = -1

    def observe(self, live: Collection[str], statuses: Mapping[str, PeerStatus], own_search: int, max_epoch: int,
                planning: bool) -> float:
        """Note what moved since the last poll; the seconds waited since the run last moved."""
        now, moved = self.clock(), []
        if self._live is not None and frozenset(live) != self._live:
            moved.append("the live peers changed")
        self._live = frozenset(live)
        if max_epoch > self._epoch:
            moved.append(f"a plan of epoch {max_epoch} was read")
            self._epoch = max_epoch
        searching = sorted(peer or "this agent" for peer, seconds in self._said(statuses, own_search).items()
                           if seconds > self._searches.get(peer, -1) >= 0)
        self._searches.update(self._said(statuses, own_search))
        if searching:
            moved.append(f"a search of the first plan ran ({', '.join(searching[:3])})")
        if planning:
            moved.append("our planner ran")
        if moved:
            self.moved_at, self.why = now, "; ".join(moved)
        return now - self.moved_at

    @staticmethod
    def _said(statuses: Mapping[str, PeerStatus], own_search: int) -> dict[str, int]:
        said = {peer: status.search for peer, status in statuses.items() if status.search >= 0}
        if own_search >= 0:
            said[""] = own_search
        return said
