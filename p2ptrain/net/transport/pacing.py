"""Keeping emulated time: precise waits, and arrival times that the receiver honours.

Real transfers on loopback take a fraction of a millisecond, and ``asyncio.sleep`` wakes up to 1 ms late
(epoll rounds its timeout up to whole milliseconds); against an emulated 5 ms link both would be errors of
10% and more. Two measures keep them out:

- A sender stamps each shaped message with its emulated arrival time and releases the last bytes
  ``TAIL_LEAD_S`` early; the receiver, if it shares the sender's monotonic clock (same machine: same boot
  ID), holds the message until the stamp. A message thus arrives at max(emulated arrival, real arrival)
  instead of their sum. Emulation is meant for swarms on one machine; from another machine the stamp is
  ignored and a message may arrive up to ``TAIL_LEAD_S`` early.
- ``Pacer.sleep_until`` sleeps on the loop to within ``SPIN_S`` and the rest in ``time.sleep`` (nanosecond
  timers) on a small thread pool, so waits end within about 0.2 ms and the loop stays free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from pathlib import Path

from p2ptrain.net.transport.messages import Stamp

SPIN_S = 0.0015  # the last stretch of a wait, slept precisely off the loop
MAX_THREADS = 8  # concurrent precise waits; more queue for at most SPIN_S
TAIL_LEAD_S = 0.005  # how early the last bytes of a shaped message leave, ahead of their stamped arrival


@functools.cache
def clock_domain() -> str | None:
    """Names the processes whose ``time.monotonic()`` agree with ours (Linux: the boot ID), or None."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:64] or None
    except OSError:
        return None


class Pacer:
    """Waits until times of ``time.monotonic()`` precisely; owned by a transport, closed with it."""

    def __init__(self):
        self.clock = time.monotonic  # stamps cross processes, so this is the machine's monotonic clock
        self._pool = concurrent.futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="p2ptrain-pacer")

    def stamp(self, time_s: float) -> Stamp | None:
        domain = clock_domain()
        return None if domain is None else Stamp(domain, time_s)

    async def sleep_until(self, when_s: float) -> None:
        delay_s = when_s - self.clock()
        if delay_s > SPIN_S:
            await asyncio.sleep(delay_s - SPIN_S)
        remaining_s = when_s - self.clock()
        if remaining_s > 0:
            await asyncio.get_running_loop().run_in_executor(self._pool, time.sleep, remaining_s)

    async def hold(self, stamp: Stamp | None, limit_s: float) -> None:
        """Wait until ``stamp`` if it is on our clock; ValueError if it lies more than ``limit_s`` ahead."""
        if stamp is None or stamp.clock != clock_domain():
            return
        if stamp.time_s - self.clock() > limit_s:
            raise ValueError(f"arrival stamp lies {stamp.time_s - self.clock():.1f} s ahead, more than {limit_s:.1f} s")
        await self.sleep_until(stamp.time_s)

    def arrived_s(self, stamp: Stamp | None, read_s: float) -> float:
        """When a message whose last bytes were read at ``read_s`` arrived: its stamped arrival if that is on our
        clock and the bytes were in by then (how late ``hold`` then woke is our scheduling, not the link's),
        else ``read_s``."""
        if stamp is None or stamp.clock != clock_domain():
            return read_s
        return max(stamp.time_s, read_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
