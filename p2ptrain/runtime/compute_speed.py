"""Emulated compute speed: a local swarm replays a mixed-GPU swarm the way link emulation replays a slow
network (DESIGN.md "Link emulation").

An agent that plays device k of a cluster file whose devices carry ``tflops`` computes ``slowdown`` =
(the fastest device's tflops) / (device k's) times as long as it does: after every stretch of compute
(a micro-batch's forward, its backward, the update after the all-reduce) that took t seconds, it sleeps
(slowdown − 1)·t. Sleeping leaves the CPU to the other agents, as a slower card would; whatever the
machine's load makes t, the ratio between agents stays that of the cards. Calibration is paced the same
way, so the leader *measures* the emulated speeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from p2ptrain.planning.cluster import Cluster


class ComputePacer:
    """Stretches compute by ``slowdown`` (1: as fast as this machine)."""

    def __init__(self, slowdown: float = 1.0):
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or not math.isfinite(slowdown) \
                or slowdown < 1.0:
            raise ValueError(f"compute slowdown must be a number of at least 1, got {slowdown!r}")
        self.slowdown = float(slowdown)
        self.slept_s = 0.0

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time the block; then sleep (slowdown − 1) times as long."""
        if self.slowdown == 1.0:
            yield
            return
        started = time.perf_counter()
        yield
        extra = (time.perf_counter() - started) * (self.slowdown - 1.0)
        self.slept_s += extra
        time.sleep(extra)


NO_PACING = ComputePacer()


def compute_slowdown(cluster: Cluster, device_index: int) -> float:
    """How many times longer device ``device_index`` computes than the cluster's fastest (1 when the
    file gives no ``tflops`` for it, or for none)."""
    speeds = [d.tflops for d in cluster.devices if d.tflops]
    own = cluster.devices[device_index].tflops
    if not speeds or not own:
        return 1.0
    return max(speeds) / own
