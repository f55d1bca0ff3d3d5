"""A brute-force event simulation of a training step, written from the runtime's code, not from the
objective's recurrences: the reference ``SimulatedObjective.simulate`` is tested against.

Every device runs a program in the executor's order (``runtime/executor.py``, ``runtime/allreduce.py``; the
forwards and backwards in the order of the run's schedule, ``runtime/schedule.py``):
blocking receives, computations, non-blocking sends. A send on the directed link a→b starts when the link is
free (FIFO in the sender's send order), occupies it size/β and arrives α + overhead later. Devices advance
one operation at a time, round robin, until each is blocked on a message not sent yet or done; since a
link has one sender, its FIFO order is that sender's program order and no global clock is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from p2ptrain.runtime.schedule import schedule_ops

Op = tuple  # ("compute", s) | ("send", dst, key, gb) | ("recv", src, key) | ("wait_sends",)


def _program(obj, sigma: np.ndarray, i: int, j: int, steps: int) -> Iterator[Op]:
    assert not obj.overlap, "the brute-force simulation has no communication threads: no overlapped buckets"
    d, s, m = obj.num_replicas, obj.num_stages, obj.micro_batches
    me = int(sigma[i, j])
    slow = obj.slowdown[me]
    prev = int(sigma[i, j - 1]) if j > 0 else None
    nxt = int(sigma[i, j + 1]) if j < s - 1 else None
    group = [int(sigma[r, j]) for r in range(d)]
    for t in range(steps):
        if t > 0:
            yield ("compute", obj.profile.boundary_s)  # the agent's work between two steps
        yield ("mark", t, "start")
        for kind, mb in schedule_ops(obj.profile.schedule, s, j, m):  # the runtime's own order
            if kind == "F":
                if prev is not None:
                    yield ("recv", prev, (t, "act", mb))
                yield ("compute", obj.forward_s[j] * slow)
                if nxt is not None:
                    yield ("send", nxt, (t, "act", mb), obj.activation_gb)
                continue
            if nxt is not None:
                yield ("recv", nxt, (t, "grad", mb))
            yield ("compute", obj.backward_s[j] * slow)
            if prev is not None:
                yield ("send", prev, (t, "grad", mb), obj.activation_grad_gb)
        yield ("mark", t, "backward_done")
        shard = obj.gradient_gb[j] / d
        for k in range(d):
            if k != i:
                yield ("send", group[k], (t, "reduce", k), shard)
        for r in range(d):
            if r != i:
                yield ("recv", group[r], (t, "reduce", i))
        for k in range(d):
            if k != i:
                yield ("send", group[k], (t, "gather", i), shard)
        for r in range(d):
            if r != i:
                yield ("recv", group[r], (t, "gather", r))
        yield ("wait_group_sends", t)
        yield ("compute", obj.update_s[j] * slow)
        yield ("wait_sends", t)
        yield ("mark", t, "end")


def event_simulation(obj, sigma: np.ndarray, steps: int) -> dict:
    """Per step: its time from the end of the step before (the last device's end, both); and every
    device's (start, backward_done, end) per step."""
    d, s = sigma.shape
    progs = {int(sigma[i, j]): _program(obj, sigma, i, j, steps) for i in range(d) for j in range(s)}
    now = {dev: 0.0 for dev in progs}
    pending: dict = {dev: None for dev in progs}  # the op a device is blocked on
    link_free: dict = {}
    arrivals: dict = {}  # (src, dst, key) -> arrival time
    sends: dict = {dev: [] for dev in progs}  # (step, kind, arrival) of each device's sends
    marks: dict = {dev: {} for dev in progs}
    done: set = set()
    while len(done) < len(progs):
        moved = False
        for dev, prog in progs.items():
            if dev in done:
                continue
            while True:
                op = pending[dev]
                if op is None:
                    try:
                        op = next(prog)
                    except StopIteration:
                        done.add(dev)
                        break
                if op[0] == "recv":
                    key = (op[1], dev, op[2])
                    if key not in arrivals:
                        pending[dev] = op
                        break
                    now[dev] = max(now[dev], arrivals[key])
                elif op[0] == "compute":
                    now[dev] += op[1]
                elif op[0] == "send":
                    dst, key, gb = op[1], op[2], op[3]
                    begin = max(now[dev], link_free.get((dev, dst), -np.inf))
                    link_free[(dev, dst)] = begin + gb * obj.s_per_gb[dev, dst]
                    arrivals[(dev, dst, key)] = link_free[(dev, dst)] + obj.delay_s[dev, dst]
                    sends[dev].append((key[0], key[1], arrivals[(dev, dst, key)]))
                elif op[0] == "wait_group_sends":
                    group = [a for t, kind, a in sends[dev] if t == op[1] and kind in ("reduce", "gather")]
                    now[dev] = max([now[dev], *group])
                elif op[0] == "wait_sends":
                    now[dev] = max([now[dev], *(a for t, _, a in sends[dev] if t == op[1])])
                elif op[0] == "mark":
                    marks[dev][(op[1], op[2])] = now[dev]
                pending[dev] = None
                moved = True
        if not moved:
            raise AssertionError("deadlock: every device waits for a message nobody sends")
    completed = [max(marks[dev][(t, "end")] for dev in progs) for t in range(steps)]
    step_s = [b - a for a, b in zip([0.0, *completed], completed, strict=False)]
    return {"step_s": step_s, "marks": marks}
