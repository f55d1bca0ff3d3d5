"""Emulated compute speed: a local swarm replays a mixed-GPU swarm the way link emulation replays a slow
network (DESIGN.md "Link emulation").

An agent that plays device k of a cluster file whose devices carry ``tflops`` computes ``slowdown`` =
(the fastest device's tflops) / (device k's) times as long as it does: after every stretch of compute
(a micro-batch's forward, its backward, the update after the all-reduce) that took t seconds, it sleeps
(slowdown − 1)·t. Sleeping leaves the CPU to the other agents, as a slower card would. On a CPU device t
is the compute thread's own CPU time (torch runs a one-thread agent's ops on the calling thread), not the
wall time: on a machine shared by a whole swarm, the time spent waiting for a core is the machine's load,
not the card's work, and multiplying it by the slowdown would make a slow card's emulation as much more
sensitive to that load. Calibration is paced the same way, so the leader *measures* the emulated speeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from p2ptrain.planning.cluster import Cluster


class ComputePacer:
    """Stretches compute by ``slowdown`` (1: as fast as this machine); ``cpu_clock``: measure the compute
    by the thread's CPU time (for a CPU device; a GPU's work is not the CPU's)."""

    def __init__(self, slowdown: float = 1.0, cpu_clock: bool = False):
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not math.isfinite(slowdown) \
                or slowdown < 1.0:
            raise ValueError(f"compute slowdown must be a number of at least 1, got {slowdown!r}")
        self.slowdown = float(slowdown)
        self.cpu_clock = cpu_clock  # time the compute by this thread's CPU time (a CPU device)
        self.slept_s = 0.0
        self.busy_s = 0.0  # wall seconds of every block, stretch included (what a step computed: ``agent.claims``)

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the block; then sleep (slowdown − 1) times as long."""
        wall = time.perf_counter()
        try:
            if self.slowdown == 1.0:
                yield
                return
            clock = time.thread_time if self.cpu_clock else time.perf_counter
            started = clock()
            yield
            extra = (clock() - started) * (self.slowdown - 1.0)
            self.slept_s += extra
            time.sleep(extra)
        finally:
            self.busy_s += time.perf_counter() - wall


NO_PACING = ComputePacer()


def compute_slowdown(cluster: Cluster, device_index: int) -> float:
    """How many times longer device ``device_index`` computes than the cluster's fastest (1 when the
    file gives no ``tflops`` for it, or for none)."""
    speeds = [d.tflops for d in cluster.devices if d.tflops]
    own = cluster.devices[device_index].tflops
    if not speeds or not own:
        return 1.0
    return max(speeds) / own
