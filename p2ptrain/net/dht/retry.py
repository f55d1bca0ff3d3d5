"""Trying a DHT call again while a crowd joins: ``retrying`` (an agent's first stores, ``agent``); how long to wait
before the next try after failures in a row (``backoff_s``: the refresher's and the links row's stores)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from p2ptrain.errors import ProtocolError

logger = logging.getLogger(__name__)


MAX_BACKOFF_S = 60.0
JITTER = 0.25  # each back-off drawn from ±this share around its mean: a crowd that failed together parts


def backoff_s(failures: int, first_s: float, max_s: float = MAX_BACKOFF_S, rng: random.Random | None = None) -> float:
    """Seconds to wait after ``failures`` (≥ 1) failed tries in a row: ``first_s`` doubled with each failure after
    the first, at most ``max_s``, jittered by ±``JITTER``."""
    mean_s = min(max_s, first_s * 2.0 ** max(0, min(failures, 64) - 1))
    return mean_s * (rng or random).uniform(1 - JITTER, 1 + JITTER)


def retrying(what: str, call: Callable[[], Any], within_s: float, wait: Callable[[float], bool] | None = None,
             first_pause_s: float = 1.0, max_pause_s: float = 16.0) -> Any:
    """``call()``, tried again after a ``ProtocolError`` (a DHT busy with a crowd joining: a store that did not
    finish within ``request_timeout_s``) after pauses of 1, 2, 4, … 16 s while ``within_s`` from now allows, each
    failure logged with what comes next; the last error once the time is up. ``wait(s)``: sleep ``s`` seconds,
    True when stopped (a signal ends the tries at once: None; the caller's loop then stops)."""
    wait = wait or (lambda s: bool(time.sleep(s)))
    deadline, pause, tries = time.monotonic() + within_s, first_pause_s, 0
    while True:
        tries += 1
        try:
            return call()
        except ProtocolError as e:
            left = deadline - time.monotonic()
            if left <= pause:
                logger.error("%s failed %d time(s) within %.0f s; giving up: %s", what, tries, within_s, e)
                raise
            logger.warning("%s failed (%s); trying again in %.0f s (%.0f s left)", what, e, pause, left)
            if wait(pause):
                return None
            pause = min(max_pause_s, 2 * pause)
