"""A follower's own searches run in one thread of lower priority, once per key, errors raised to the caller."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from p2ptrain.agent.leadership import searches


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="threads have nice values of their own on Linux only")
def test_a_search_runs_in_a_thread_below_the_callers_priority():
    before = _nice()
    assert searches.run(None, _nice) == min(19, before + searches.CHECK_NICE)
    assert _nice() == before  # the caller's own is untouched


def test_a_search_of_a_key_in_flight_is_waited_for_not_run_again():
    calls, gate = [], threading.Event()

    def search() -> str:
        calls.append(1)
        gate.wait(10)
        return "plan"

    results: list[str] = []
    callers = [threading.Thread(target=lambda: results.append(searches.run(b"same", search))) for _ in range(3)]
    for caller in callers:
        caller.start()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the other callers find the search in flight
    gate.set()
    for caller in callers:
        caller.join(10)
    assert results == ["plan"] * 3 and len(calls) == 1
    assert searches.run(b"same", lambda: "again") == "again"  # done: a later search of the key runs


def test_a_failed_search_raises_in_its_caller_and_the_thread_goes_on():
    def fails() -> None:
        raise ValueError("no plan: too few devices")

    with pytest.raises(ValueError, match="too few devices"):
        searches.run(b"failing", fails)
    assert searches.run(b"failing", lambda: 7) == 7


def test_a_check_that_cannot_reuse_our_last_search_says_which_inputs_differ(monkeypatch, caplog):
    """Same devices, other links: the follower's second search is a new one, and its log line names what differs."""
    import dataclasses

    from p2ptrain.agent.config import PlanConfig
    from p2ptrain.agent.leadership.plan_maker import make_plan
    from p2ptrain.planning import Workload
    from p2ptrain.planning.scenarios import scenario

    monkeypatch.setattr(searches, "_searched", type(searches._searched)())
    monkeypatch.setattr(searches, "_last_parts", None)
    cluster, workload = scenario("worldwide", 8), Workload(0.01, 0.1)
    make_plan(cluster, workload, 2, PlanConfig(), check=True)
    caplog.set_level("INFO", logger=searches.__name__)
    make_plan(cluster, workload, 2, PlanConfig(), check=True)
    assert "as searched before" in caplog.text and "anew" not in caplog.text
    slower = dataclasses.replace(cluster, bandwidth_gbps=cluster.bandwidth_gbps * 0.5)
    make_plan(slower, workload, 2, PlanConfig(), check=True)
    assert "searching these 8 devices anew: their cluster.bandwidth_gbps differ" in caplog.text
