"""The first plan's wait (``leadership.plan_wait.PlanWait``), without I/O: what restarts the clock that
``membership.plan_timeout_s`` bounds, and what does not."""

from __future__ import annotations

from p2ptrain.agent.leadership.plan_wait import PlanWait
from p2ptrain.net.transport.status import PeerStatus

LIVE = ("peerA", "peerB", "peerC")


def clocked() -> tuple[PlanWait, list[float]]:
    """A wait that started at 100 s, and its clock (``now[0]``)."""
    now = [100.0]
    return PlanWait(now[0], lambda: now[0]), now


def test_the_clock_runs_from_the_start_while_nothing_moves():
    wait, now = clocked()
    now[0] += 10.0
    assert wait.observe(LIVE, {}, -1, -1, False) == 10.0  # the first look at the peers is no move
    now[0] += 50.0
    statuses = {"peerB": PeerStatus(search=30), "peerC": PeerStatus()}  # a search that ended: said, not running
    assert wait.observe(LIVE, statuses, 12, -1, False) == 60.0
    now[0] += 1000.0
    assert wait.observe(LIVE, statuses, 12, -1, False) == 1060.0 and wait.why == "the agent started"


def test_peers_coming_a_plan_read_and_searches_that_run_restart_it():
    wait, now = clocked()
    wait.observe(LIVE[:2], {}, -1, -1, False)
    now[0] += 100.0
    assert wait.observe(LIVE, {}, -1, -1, False) == 0.0 and "live peers" in wait.why  # a peer joined
    now[0] += 100.0
    assert wait.observe(LIVE, {"peerB": PeerStatus(search=5)}, -1, -1, False) == 100.0  # first heard: no move yet
    now[0] += 100.0
    assert wait.observe(LIVE, {"peerB": PeerStatus(search=105)}, -1, -1, False) == 0.0  # a checker searches on
    assert "peerB" in wait.why
    now[0] += 100.0
    assert wait.observe(LIVE, {"peerB": PeerStatus(search=105)}, 0, -1, False) == 100.0
    now[0] += 100.0
    assert wait.observe(LIVE, {"peerB": PeerStatus(search=105)}, 90, -1, False) == 0.0  # our own search runs
    assert "this agent" in wait.why
    now[0] += 100.0
    assert wait.observe(LIVE, {}, 90, -1, True) == 0.0 and wait.why == "our planner ran"  # we lead and search
    now[0] += 100.0
    assert wait.observe(LIVE, {}, 90, 0, False) == 0.0 and "epoch 0" in wait.why  # a plan came (refused, say)
    now[0] += 100.0
    assert wait.observe(LIVE, {}, 90, 0, False) == 100.0  # the same plan again: no move
