"""The step-boundary check off the training thread (agent.boundary): answers, errors, stopping."""

from __future__ import annotations

import threading
import time

import pytest

from p2ptrain.agent.churn.boundary import BoundaryWatch, overshot

pytestmark = pytest.mark.timeout(30)


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_latest_answer_is_read_without_running_the_check_on_the_reading_thread():
    answers = iter(range(1_000_000))
    threads = set()

    def check():
        threads.add(threading.current_thread().name)
        return next(answers)

    with BoundaryWatch(check, interval_s=0.01) as watch:
        _until(lambda: watch.checks >= 3)
        first = watch.plan
        _until(lambda: watch.plan != first)
        assert watch.plan > first
    assert threads == {"p2ptrain-boundary"}


def test_nothing_is_answered_before_the_first_check():
    release = threading.Event()
    watch = BoundaryWatch(lambda: release.wait(5) and "plan", interval_s=0.01).start()
    try:
        assert watch.plan is None
    finally:
        release.set()
        watch.stop()


def test_a_failed_check_is_raised_to_the_reader_once_and_stops_the_watch():
    class Refused(Exception):
        pass

    def check():
        raise Refused("the run's plans are made by peers training other data")

    watch = BoundaryWatch(check, interval_s=0.01).start()
    _until(lambda: not watch._thread.is_alive())
    with pytest.raises(Refused):
        watch.plan  # noqa: B018
    assert watch.plan is None
    watch.stop()


def test_stop_waits_for_the_check_in_progress_and_no_check_runs_after():
    running, calls = threading.Event(), []

    def check():
        running.set()
        time.sleep(0.2)
        calls.append(1)
        return len(calls)

    watch = BoundaryWatch(check, interval_s=0.01).start()
    running.wait(5)
    watch.stop()
    done = len(calls)
    assert done >= 1 and not watch._thread.is_alive()
    time.sleep(0.05)
    assert len(calls) == done


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        BoundaryWatch(lambda: None, interval_s=0)


def test_the_pause_between_checks_follows_the_steps_within_its_bounds():
    now = [0.0]
    watch = BoundaryWatch(lambda: None, interval_s=0.2, max_interval_s=1.0, clock=lambda: now[0])
    assert watch.interval_s == 0.2
    for step_s, expected in [(0.6, 0.3), (5.0, 1.0), (0.1, 0.2), (1.0, 0.5)]:
        watch.plan  # noqa: B018  (a step boundary)
        now[0] += step_s
        watch.plan  # noqa: B018
        assert watch.interval_s == pytest.approx(expected)


def test_a_trainer_that_passed_a_newer_plans_start_has_overshot():
    # epoch 0's trainer had done 53 steps at its last boundary; epoch 1 starts after step 53: the step in
    # flight is one its peers will not finish (they stopped at 53)
    assert overshot(53, training_epoch=0, plan_epoch=1, done=53)
    assert overshot(52, training_epoch=0, plan_epoch=1, done=53)
    assert not overshot(55, training_epoch=0, plan_epoch=1, done=53)  # still ahead: it halts at that boundary
    assert not overshot(53, training_epoch=1, plan_epoch=1, done=60)  # the plan it trains
    assert not overshot(53, training_epoch=None, plan_epoch=1, done=None)  # between epochs
    assert not overshot(53, training_epoch=0, plan_epoch=1, done=None)  # a spare, or before its first boundary
