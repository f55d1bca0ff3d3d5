"""Emulated compute speed: a local swarm replays a mixed-GPU swarm the way link emulation replays a slow
network (docs/design.md "Link emulation").

An agent that plays device k of a cluster file whose devices carry ``tflops`` computes ``slowdown`` =
(the fastest device's tflops) / (device k's) times as long as it does: a stretch of compute (a
micro-batch's forward, its backward, the update after the all-reduce) that took t seconds of this machine's
work ends slowdown·t after it began: the agent sleeps for what is left of that once the work is done.
Sleeping leaves the CPU to the other agents, as a slower card would. On a CPU device t is the compute
thread's own CPU time (torch runs a one-thread agent's ops on the calling thread), not the wall time: on a
machine shared by a whole swarm, the time spent waiting for a core is the machine's load, not the card's
work. A wait for a core shorter than the card's extra time is absorbed in it (a card of its own would not
have waited at all); only a longer one shows, as the load it is. Calibration is paced the same way, so the
leader *measures* the emulated speeds.

An emulation's ``compute_scale`` plays every device that many times slower still (the fastest one too):
with the network's time scale grown alike it is the same world in slow motion. A swarm of more agents than
this machine has cores needs it (``fitting_scale``): every card of the world computes on its own, while
the agents that play them wait for each other's cores unless the sleeps leave room for all.
"""

from __future__ import annotations

import math
import os
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
        self.busy_s = 0.0  # wall seconds of every block, stretch included (what a step computed: ``leadership.claims``)
        self.busy_cpu_s = 0.0  # the computing thread's CPU seconds in every block: busy_s less its waits

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the block; then sleep until ``slowdown`` times its work has passed since it began."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            if self.slowdown == 1.0:
                yield
                return
            clock = time.thread_time if self.cpu_clock else time.perf_counter
            started = clock()
            yield
            extra = max(0.0, self.slowdown * (clock() - started) - (time.perf_counter() - wall))
            if extra > 0:
                self.slept_s += extra
                time.sleep(extra)
        finally:
            self.busy_s += time.perf_counter() - wall
            self.busy_cpu_s += time.thread_time() - cpu


NO_PACING = ComputePacer()


def compute_slowdown(cluster: Cluster, device_index: int, scale: float = 1.0) -> float:
    """How many times longer device ``device_index`` computes than this machine's core: ``scale`` (the
    emulation's ``compute_scale``) times as long as the cluster's fastest device does, which the core plays
    at ``scale`` 1 (the file gives no ``tflops`` for it, or for none: as the fastest)."""
    speeds = [d.tflops for d in cluster.devices if d.tflops]
    own = cluster.devices[device_index].tflops
    if not speeds or not own:
        return scale
    return scale * max(speeds) / own


def fitting_scale(cluster: Cluster, cores: int | None = None) -> float:
    """The least ``compute_scale`` (at least 1) at which the compute of one agent per device of ``cluster``
    fits ``cores`` (default: the cores this process may run on) when every device computes at once: each
    agent keeps a core busy 1/slowdown of the time, so the swarm needs Σ 1/slowdown cores. Beyond that the
    agents wait for a core, a wait the emulated devices would not know, and the leader, which prices each
    device's compute as it calibrated it, predicts too short a step (benchmarks/README.md measures it)."""
    cores = cores or usable_cores()
    demand = sum(1.0 / compute_slowdown(cluster, k) for k in range(cluster.num_devices))
    return max(1.0, demand / cores)


def usable_cores() -> int:
    """The cores this process may run on (all of the machine's where the system cannot say)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
