import concurrent.futures
import threading

import pytest

from p2ptrain.futures import wait_all


def test_results_come_back_in_order_of_the_futures():
    futures = [concurrent.futures.Future() for _ in range(3)]
    for value, future in zip((2, 0, 1), reversed(futures), strict=True):
        future.set_result(value)
    assert wait_all(futures) == [1, 0, 2]
    assert wait_all([]) == []


def test_a_failure_is_raised_while_an_earlier_future_is_still_pending():
    pending, failed = concurrent.futures.Future(), concurrent.futures.Future()
    failed.set_exception(TimeoutError("peer 7 did not answer"))
    late = threading.Timer(10.0, pending.set_result, (None,))  # the test ends even if wait_all waited for it
    late.start()
    try:
        with pytest.raises(TimeoutError, match="peer 7"):
            wait_all([pending, failed])
        assert not pending.done()
    finally:
        late.cancel()


def test_a_cancelled_future_is_raised_without_waiting_for_the_others():
    ok, cancelled = concurrent.futures.Future(), concurrent.futures.Future()
    late = threading.Timer(10.0, ok.set_result, (3,))
    late.start()
    threading.Timer(0.05, cancelled.cancel).start()  # cancelled while wait_all waits: never "done" for wait()
    try:
        with pytest.raises(concurrent.futures.CancelledError):
            wait_all([ok, cancelled])
        assert not ok.done()
    finally:
        late.cancel()
