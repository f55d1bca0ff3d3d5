"""The refresher's stores on a DHT that does not answer in time: backed off, and always of the newest record."""

from __future__ import annotations

import random
import threading
import time

import pytest

from p2ptrain.errors import PeerTimeoutError
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import PeerRecord
from p2ptrain.net.dht.refresh import Refresher
from p2ptrain.net.dht.retry import JITTER, backoff_s


def test_a_back_off_doubles_with_each_failure_in_a_row_up_to_its_cap_jittered():
    rng = random.Random(0)
    for failures, mean in ((1, 2.0), (2, 4.0), (3, 8.0), (5, 32.0), (6, 60.0), (1000, 60.0)):
        drawn = [backoff_s(failures, 2.0, 60.0, rng) for _ in range(200)]
        assert all(mean * (1 - JITTER) <= d <= mean * (1 + JITTER) for d in drawn)
        assert max(drawn) - min(drawn) > mean * JITTER  # a crowd that failed together parts


class _FlakyStore:
    """A DHT store that times out ``fails`` times, then stores; what it was asked to store, and when."""

    def __init__(self, fails: int):
        self.fails, self.calls, self.lock = fails, [], threading.Lock()

    def __call__(self, kind: RecordKind, record) -> bool:
        with self.lock:
            self.calls.append((time.monotonic(), record))
            if self.fails > 0:
                self.fails -= 1
                raise PeerTimeoutError("DHT store did not finish within request_timeout_s=10.0")
            return True


def _record(tflops: float) -> PeerRecord:
    return PeerRecord("cpu", 8.0, tflops)


def test_failed_stores_are_tried_again_less_and_less_often_and_always_of_the_newest_record():
    store = _FlakyStore(fails=1000)
    refresher = Refresher(store, lambda kind: 600.0, retry_s=0.1)
    refresher.start()
    try:
        with pytest.raises(PeerTimeoutError):
            refresher.publish(_record(1.0), refresh=True)
        newest = _record(2.0)
        with pytest.raises(PeerTimeoutError):  # a newer record whose store fails too replaces the old one
            refresher.publish(newest, refresh=True)
        time.sleep(1.5)
    finally:
        refresher.stop(5.0)
    retries = store.calls[2:]
    # every 0.1 s without a back-off: about 15; with it (0.2, 0.4, 0.8 s ...) at most 3 fit in 1.5 s
    assert 1 <= len(retries) <= 4, [round(t - store.calls[1][0], 2) for t, _ in retries]
    assert all(record is newest for _, record in retries)


def test_a_record_is_stored_on_its_period_again_once_the_dht_answers():
    store = _FlakyStore(fails=2)
    refresher = Refresher(store, lambda kind: 0.5, retry_s=0.05)
    refresher.start()
    try:
        record = _record(1.0)
        with pytest.raises(PeerTimeoutError):
            refresher.publish(record, refresh=True)
        deadline = time.monotonic() + 30.0
        while len(store.calls) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        refresher.stop(5.0)
    assert len(store.calls) >= 5 and all(r is record for _, r in store.calls)
    stored_at = [t for t, _ in store.calls[2:]]  # the third call stored it; then once a period (0.5 s), not sooner
    assert all(b - a >= 0.45 for a, b in zip(stored_at, stored_at[1:], strict=False))
