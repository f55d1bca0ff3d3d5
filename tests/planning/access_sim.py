"""A brute-force event simulation in time order over access links, written from the model's statement (the
emulator's, ``net/transport/emulation.py``), not from the objective's recurrences: the reference that
``SimulatedObjective.simulate`` is tested against where the objective's queue order is time order.

One global clock and a heap of events. A message handed over at t takes, in the order the heap reaches its
hand-over, s = max(t, pair_free[a→b], up_free[a]) (the uplink only where a has one), frees the pair at
s + n/min(β, U_a) and the uplink at s + n/U_a; its first bytes reach b at s + α (an event), where b's
downlink (if any) serves it in the order first bytes come, d = max(s + α, down_free[b]); it is delivered at
max(d + n/D_b, s + n/min(β, U_a) + α). Every device runs the executor's program (``runtime/executor.py``):
its schedule's forwards and backwards, blocking receives, non-blocking sends; its last backward pass makes
its buckets (handed over at the times the objective's overlap model gives them: stage 0's during the pass,
a later stage's at its end, after the pass's gradient to the stage before, handed over first among equal
times); an owner hands over a bucket's all-gather shards once
it has the bucket's shards and its own; the clip's norms leave once the sender's uplink is free (the
objective's model of a scalar). Events at equal times go in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from p2ptrain.planning.wire_model import BACKWARD, schedule_ops

INF = float("inf")


class _World:
    def __init__(self, obj):
        self.obj = obj
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.pair_free: dict = {}
        self.up_free: dict = {}
        self.down_free: dict = {}
        self.delivered: dict = {}
        self.waiting: dict = {}  # key -> [callbacks]
        self.up_after_sends: dict = {}

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run(self) -> None:
        while self.heap:
            t, _, fn = heapq.heappop(self.heap)
            assert t >= self.now - 1e-9, "an event in the past"
            self.now = max(self.now, t)
            fn()

    def hand_over(self, t: float, a: int, b: int, gb: float, key) -> None:
        def go():
            obj = self.obj
            s = max(t, self.pair_free.get((a, b), -INF), self.up_free.get(a, -INF) if obj.has_up[a] else -INF)
            self.pair_free[(a, b)] = s + gb * obj.send_s_per_gb[a, b]
            if obj.has_up[a]:
                self.up_free[a] = s + gb * obj.up_s_per_gb[a]
            last = s + gb * obj.send_s_per_gb[a, b] + obj.delay_s[a, b]
            self.at(s + obj.delay_s[a, b], lambda: self._arrive(s + obj.delay_s[a, b], b, gb, last, key))

        self.at(t, go)

    def _arrive(self, first: float, b: int, gb: float, last: float, key) -> None:
        obj = self.obj
        f = last
        if obj.has_down[b]:
            d = max(first, self.down_free.get(b, -INF))
            self.down_free[b] = d + gb * obj.down_s_per_gb[b]
            f = max(self.down_free[b], last)
        self.at(f, lambda: self._deliver(key, f))

    def _deliver(self, key, f: float) -> None:
        self.delivered[key] = f
        for fn in self.waiting.pop(key, []):
            fn()

    def when(self, keys: list, fn) -> None:
        """Call ``fn(latest delivery)`` once every key is delivered."""
        pending = [k for k in keys if k not in self.delivered]
        if not pending:
            fn(max([self.delivered[k] for k in keys], default=-INF))
            return
        self.waiting.setdefault(pending[0], []).append(lambda: self.when(keys, fn))


def access_event_simulation(obj, sigma: np.ndarray, steps: int, all_reduce: bool = True) -> dict:
    """Per step: its time from the end of the step before (the last device's end, both)."""
    world = _World(obj)
    d, s = sigma.shape
    m = obj.micro_batches
    slow = obj.slowdown[sigma]
    k_all = obj.buckets
    valid = obj.bucket_share > 0
    ends: dict = {}  # (step, i, j) -> end time
    reduce_ready: dict = {}  # (step, j, owner, k) -> its own bucket's readiness

    def device(i: int, j: int):
        me = int(sigma[i, j])
        prev = int(sigma[i, j - 1]) if j > 0 else None
        nxt = int(sigma[i, j + 1]) if j < s - 1 else None
        group = [int(sigma[r, j]) for r in range(d)]
        ops = schedule_ops(obj.profile.schedule, s, j, m)
        last_b = max(n for n, (kind, _) in enumerate(ops) if kind == BACKWARD)
        shared = all_reduce and d > 1

        def step(t: int, start: float):
            pipeline_sends: list = []
            state = {"busy": start}

            def op(n: int):
                if n == len(ops):
                    return finish()
                kind, mb = ops[n]
                need = []
                if kind != BACKWARD and prev is not None:
                    need = [(t, "act", mb, i, j)]
                if kind == BACKWARD and nxt is not None:
                    need = [(t, "grad", mb, i, j)]
                world.when(need, lambda arrived: compute(n, kind, mb, max(state["busy"], arrived)))

            def compute(n: int, kind: str, mb: int, begin: float):
                if kind != BACKWARD:
                    state["busy"] = begin + obj.forward_s[j] * slow[i, j]
                    world.at(state["busy"], lambda: forward_done(n, mb))
                    return
                state["busy"] = begin + obj.backward_s[j] * slow[i, j]
                if n == last_b:
                    state["last_start"] = begin
                if prev is not None:  # the pass's gradient, handed over first among equal times
                    key = (t, "grad", mb, i, j - 1)
                    world.hand_over(state["busy"], me, prev, obj.activation_grad_gb, key)
                    pipeline_sends.append(key)
                if n == last_b and shared:
                    buckets(begin)
                world.at(state["busy"], lambda: op(n + 1))

            def forward_done(n: int, mb: int):
                if nxt is not None:
                    key = (t, "act", mb, i, j + 1)
                    world.hand_over(world.now, me, nxt, obj.activation_gb, key)
                    pipeline_sends.append(key)
                op(n + 1)

            def buckets(begin: float):
                bwd = obj.backward_s[j] * slow[i, j]
                for k in range(k_all):
                    if not valid[j, k]:
                        continue
                    # stages after 0 hold their buckets until the pass's gradient is handed over (runtime.buckets)
                    ready = begin + obj.bucket_ready[j, k] * bwd if obj.overlap and j == 0 else state["busy"]
                    reduce_ready[(t, j, i, k)] = ready
                    shard = obj.gradient_gb[j] * obj.bucket_share[j, k] / d
                    for r in range(d):
                        if r != i:
                            world.hand_over(ready, me, group[r], shard, (t, "rs", j, k, i, r))
                    incoming = [(t, "rs", j, k, r, i) for r in range(d) if r != i]
                    world.when(incoming, lambda last, k=k, ready=ready, shard=shard: gather(k, max(ready, last), shard))

            def gather(k: int, at: float, shard: float):
                for r in range(d):
                    if r != i:
                        world.hand_over(at, me, group[r], shard, (t, "ag", j, k, i, r))

            def finish():
                done = state["busy"]
                keys = []
                if shared:
                    keys = [(t, kind, j, k, a, b) for kind in ("rs", "ag") for k in range(k_all) if valid[j, k]
                            for a, b in ((i, r) for r in range(d) if r != i)]  # its own sends
                    keys += [(t, "ag", j, k, r, i) for k in range(k_all) if valid[j, k] for r in range(d) if r != i]
                world.when(keys, lambda last: reduced(max(done, last)))

            def reduced(at: float):
                if obj.profile.clip and s > 1:  # norms leave once the uplink is free; wait for the others'
                    leave = max(at, world.up_free.get(me, -INF) if obj.has_up[me] else -INF)
                    for k in range(s):
                        if k != j:
                            key = (t, "norm", i, j, k)
                            at_k = leave + obj.delay_s[me, int(sigma[i, k])]
                            world.at(at_k, lambda key=key: world._deliver(key, world.now))
                    world.when([(t, "norm", i, k, j) for k in range(s) if k != j],
                               lambda last: update(max(at, last)))
                    return
                update(at)

            def update(at: float):
                updated = at + obj.update_s[j] * slow[i, j]
                world.when(pipeline_sends, lambda last: end(max(updated, last)))

            def end(at: float):
                ends[(t, i, j)] = at
                if t + 1 < steps:
                    world.at(at + obj.profile.boundary_s, lambda: step(t + 1, world.now))

            op(0)

        return step

    for i in range(d):
        for j in range(s):
            world.at(0.0, lambda i=i, j=j: device(i, j)(0, 0.0))
    world.run()
    completed = [max(ends[(t, i, j)] for i in range(d) for j in range(s)) for t in range(steps)]
    return {"step_s": [b - a for a, b in zip([0.0, *completed], completed, strict=False)]}
