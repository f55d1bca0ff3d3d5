"""The event simulation of a plan's steps (``docs/simulated.md``, "The event simulation"): every pipeline's
micro-batches over per-link FIFOs in the schedule's order, each group's bucketed all-reduce, the checks'
messages, clipping and DiLoCo's round end, vectorised over pipelines and groups; with access links the
queues are ``access.Access``'s. ``step_period`` is the statistic a prediction and a measurement report."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from p2ptrain.planning.simulated.access import ALL_REDUCE_ROUNDS, Access
from p2ptrain.planning.wire_model import BACKWARD

if TYPE_CHECKING:
    from p2ptrain.planning.simulated.objective import SimulatedObjective

MAX_SIMULATED_BUCKETS = 8  # an overlapped all-reduce is simulated in at most this many (merged) buckets


@dataclass(frozen=True)
class SimulatedSteps:
    """The event simulation of an assignment: each step's time (from when the last device ended the step
    before to when the last device ends this one), and the split of the prediction at the device that ends
    the last step: its forward/backward part, and the rest (all-reduce, update, the pause between steps)."""

    step_s: tuple[float, ...]
    pipeline_s: float
    data_parallel_s: float
    sync_every: int = 1  # DiLoCo: ``step_s`` are steps without the all-reduce, one in this many has it ...
    sync_extra_s: float = 0.0  # ... and takes this much longer (streamed: the round is this much longer)

    @property
    def predicted_s(self) -> float:
        """The period of the steps after the first (warm-up) one (``step_period``); DiLoCo: plus the round's
        all-reduce spread over its steps."""
        return step_period(self.step_s[1:]) + self.sync_extra_s / self.sync_every


def bucket_shares(gradient_gb: np.ndarray, bucket_gb: float) -> np.ndarray:
    """Each stage's all-reduce buckets as shares of its gradients ([stage, bucket], rows padded with 0), as the
    runtime cuts them (``runtime.buckets.plan_buckets``): full buckets of ``bucket_gb`` while the backward
    pass goes on, the remainder last; one bucket without overlap (``bucket_gb`` 0). A stage of more than
    ``MAX_SIMULATED_BUCKETS`` buckets is simulated in that many equal ones (merged)."""
    gradient_gb = np.asarray(gradient_gb, dtype=float)
    if bucket_gb <= 0:
        return np.ones((len(gradient_gb), 1))
    rows = []
    for g in gradient_gb:
        count = max(1, math.ceil(g / bucket_gb - 1e-9))
        if count > MAX_SIMULATED_BUCKETS:
            rows.append([1.0 / MAX_SIMULATED_BUCKETS] * MAX_SIMULATED_BUCKETS)
        else:
            full = bucket_gb / g if g > 0 else 1.0
            rows.append([full] * (count - 1) + [1.0 - full * (count - 1)])
    out = np.zeros((len(rows), max(len(r) for r in rows)))
    for j, r in enumerate(rows):
        out[j, : len(r)] = r
    return out


def step_period(times: Sequence[float]) -> float:
    """The period of a series of step times: the median of the means of each two consecutive steps (a single
    step's time when there is only one). Alternating long and short steps give their mean; one slow step
    among many is shed."""
    if len(times) < 2:
        return float(times[0])
    return float(statistics.median((a + b) / 2 for a, b in zip(times, times[1:], strict=False)))


def simulate_steps(obj: SimulatedObjective, sigma: np.ndarray, steps: int, all_reduce: bool = True,
                   round_end: bool = False) -> SimulatedSteps:
    """``steps`` steps of ``sigma``; ``all_reduce``: with the groups' all-reduce, during and after the last
    backward pass as every-step sync runs it, or with ``round_end`` as a DiLoCo round's end runs it
    (``outer_rounds.OuterRounds._outer_step``): after the clip's exchange and the update, every bucket at once."""
    run = _Run.of(obj, sigma, all_reduce and not round_end)
    d, s = obj.num_replicas, obj.num_stages
    start = np.zeros((d, s))
    step_s: list[float] = []
    completed = pipeline_s = 0.0
    shadow = run.in_step and obj.sum_shadow  # each step's sum check runs in the next one's shadow
    for _ in range(steps):
        checked = _sum_check(obj, run, start) if shadow else None  # the step before's, from this step's start
        if run.in_step and obj.reveal_gb.any():  # the recompute check's reveals, ahead of the step's sends
            run.free_g = _reveal(obj, sigma, start, run.free_g, run.access)
        busy, sent, last_start, all_reduced = _pipeline(obj, run, start)
        backward_done = busy.T  # [j, i]
        if not run.shared_all_reduce:
            all_reduced = backward_done
        if run.in_step and run.access is None:
            all_reduced, run.free_g = _all_reduce(obj, last_start.T, run.bwd.T, backward_done, run.free_g, run.ser_g,
                                                  run.lat_g)
        reduced = _after_all_reduce(obj, run, all_reduced.T, shadow)
        if checked is not None:  # the step's hook waits for the step before's check
            reduced = np.maximum(reduced, checked)
        end = np.maximum(reduced + run.upd, sent)
        if d > 1 and all_reduce and round_end:  # DiLoCo: the pseudo-gradients once the update is done
            updated = reduced + run.upd
            if run.access is None:
                done, run.free_g = _all_reduce(obj, last_start.T, run.bwd.T, updated.T, run.free_g, run.ser_g,
                                               run.lat_g, overlap=False)
            else:
                done = np.stack([run.access.all_reduce(j, last_start[:, j], run.bwd[:, j], updated[:, j],
                                                       round_end=True)[0] for j in range(s)])
            end = np.maximum(done.T, sent)
        crit = np.unravel_index(int(np.argmax(end)), end.shape)  # the device that ends the step last
        pipeline_s = float(busy[crit] - start[crit])
        step_s.append(float(end[crit]) - completed)
        completed = float(end[crit])
        start = end + obj.profile.boundary_s
    predicted = step_period(step_s[1:])  # ``SimulatedSteps.predicted_s``
    return SimulatedSteps(step_s=tuple(step_s), pipeline_s=pipeline_s, data_parallel_s=predicted - pipeline_s)


@dataclass
class _Run:
    """What a simulation keeps across its steps: each device's pass times (with its slowdown, the recompute
    check's share and the codecs' time on the compute thread), each pipeline hop's and group pair's latency
    and serialisation, and the links' FIFOs (free times), which ``access`` shares where there are access
    links. ``in_step``: every-step sync (the all-reduce in the step); ``shared_all_reduce``: over access
    links, each stage's all-reduce once its last backward is done (``Access.all_reduce``)."""

    sigma: np.ndarray
    fwd: np.ndarray  # [pipeline, stage]
    bwd: np.ndarray
    upd: np.ndarray
    hop: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # forward latency, serialisation; backward's
    lat_g: np.ndarray  # [j, i, k]: the link from member i to member k of stage j's group
    ser_g: np.ndarray  # [j, i, k, bucket]: one bucket's shard on it
    free_f: np.ndarray  # [pipeline, hop]
    free_b: np.ndarray
    free_g: np.ndarray  # [stage, src, dst]
    access: Access | None
    in_step: bool
    last_backward: dict[int, int]  # per stage: its last backward pass's index in the step's order

    @property
    def shared_all_reduce(self) -> bool:
        return self.access is not None and self.in_step

    @classmethod
    def of(cls, obj: SimulatedObjective, sigma: np.ndarray, every_step: bool) -> _Run:
        d, s = obj.num_replicas, obj.num_stages
        a, b = sigma[:, :-1], sigma[:, 1:]  # pipeline i's hop h: a[i, h] → b[i, h]
        hop = (obj.delay_s[a, b], obj.activation_gb * obj.send_s_per_gb[a, b],
               obj.delay_s[b, a], obj.activation_grad_gb * obj.send_s_per_gb[b, a])
        cols = sigma.T  # cols[j, i]: stage j's member of pipeline i
        src, dst = cols[:, :, None], cols[:, None, :]
        shard_gb = obj.gradient_gb[:, None] * obj.bucket_share / d  # [j, k]: one bucket's shard
        slow = obj.slowdown[sigma]
        grow = slow * obj.recompute_factor  # the recompute check's share of each pass (steps 1–2)
        last_backward = {j: max(k for k, (kind, jj, _) in enumerate(obj.order) if kind == BACKWARD and jj == j)
                         for j in range(s)}
        free_f = np.full((d, s - 1), -np.inf)  # when each link is free again (FIFO), kept across steps
        free_b = np.full((d, s - 1), -np.inf)
        free_g = np.full((s, d, d), -np.inf)
        access = Access(obj, sigma, free_f, free_b, free_g) if obj.access else None
        return cls(sigma=sigma, fwd=obj.forward_s * grow + obj.codec_forward_s, bwd=obj.backward_s * grow,
                   upd=obj.update_s * slow, hop=hop, lat_g=obj.delay_s[src, dst],
                   ser_g=shard_gb[:, None, None, :] * obj.s_per_gb[src, dst][..., None], free_f=free_f,
                   free_b=free_b, free_g=free_g, access=access, in_step=d > 1 and every_step,
                   last_backward=last_backward)


def _pipeline(obj: SimulatedObjective, run: _Run, start: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One step's forward and backward passes from ``start`` ([pipeline, stage]), each stage in its own order
    (``wire_model.step_order``): when each device is done computing, when its last pipeline message arrived,
    when it began its last backward pass, and (over access links with every-step sync) when each stage's
    all-reduce is done ([stage, pipeline]; otherwise unset)."""
    d, s, m = obj.num_replicas, obj.num_stages, obj.micro_batches
    lat_f, ser_f, lat_b, ser_b = run.hop
    free_f, free_b, access = run.free_f, run.free_b, run.access
    busy = start.copy()  # when each device is done with what it computed so far
    sent = start.copy()  # when each device's last pipeline message arrived
    arrive_f = np.zeros((d, s, m))  # when micro-batch mb's activations reach stage j
    arrive_b = np.zeros((d, s, m))  # ... and its gradient
    last_start = start.copy()  # when each device began its last backward pass
    all_reduced = np.empty((s, d))
    for k, (kind, j, mb) in enumerate(obj.order):
        if kind != BACKWARD:
            busy[:, j] = (busy[:, j] if j == 0 else np.maximum(busy[:, j], arrive_f[:, j, mb])) + run.fwd[:, j]
            if j < s - 1:
                if access is not None:
                    arrive_f[:, j + 1, mb] = access.send(free_f, j, j, j + 1, obj.activation_gb, busy[:, j])
                else:
                    free_f[:, j] = np.maximum(busy[:, j], free_f[:, j]) + ser_f[:, j]
                    arrive_f[:, j + 1, mb] = free_f[:, j] + lat_f[:, j]
                sent[:, j] = np.maximum(sent[:, j], arrive_f[:, j + 1, mb])
            continue
        ready = (busy[:, j] if j == s - 1 else np.maximum(busy[:, j], arrive_b[:, j, mb])) + obj.codec_before_backward_s[j]
        if k == run.last_backward[j]:
            last_start[:, j] = ready
        busy[:, j] = ready + run.bwd[:, j] + obj.codec_after_backward_s[j]
        if run.shared_all_reduce and k == run.last_backward[j]:
            all_reduced[j], tail = access.all_reduce(j, last_start[:, j], run.bwd[:, j], busy[:, j])
            if j > 0:
                arrive_b[:, j - 1, mb] = tail
                sent[:, j] = np.maximum(sent[:, j], tail)
            continue
        if j > 0:
            if access is not None:
                arrive_b[:, j - 1, mb] = access.send(free_b, j - 1, j, j - 1, obj.activation_grad_gb, busy[:, j])
            else:
                free_b[:, j - 1] = np.maximum(busy[:, j], free_b[:, j - 1]) + ser_b[:, j - 1]
                arrive_b[:, j - 1, mb] = free_b[:, j - 1] + lat_b[:, j - 1]
            sent[:, j] = np.maximum(sent[:, j], arrive_b[:, j - 1, mb])
    return busy, sent, last_start, all_reduced


def _after_all_reduce(obj: SimulatedObjective, run: _Run, reduced: np.ndarray, shadow: bool = False) -> np.ndarray:
    """From when each device's gradients are reduced ([pipeline, stage]) to when it may update: the sum check
    (``_sum_check``; not in ``shadow`` mode, where it runs in the next step's), and the clip's norms (step 4)."""
    s, sigma, access = obj.num_stages, run.sigma, run.access
    if run.in_step and not shadow:
        reduced = _sum_check(obj, run, reduced)
    if obj.profile.clip and s > 1:  # every other stage's norm (the diagonal's delay is 0: its own)
        delay = obj.delay_s[sigma[:, :, None], sigma[:, None, :]]
        if access is None:
            return (reduced[:, :, None] + delay).max(axis=1)
        others = np.where(np.eye(s, dtype=bool), -np.inf, delay)  # a norm leaves once its sender's uplink is free
        return np.maximum(reduced, (np.maximum(reduced, access.up_free)[:, :, None] + others).max(axis=1))
    return reduced


def _sum_check(obj: SimulatedObjective, run: _Run, at: np.ndarray) -> np.ndarray:
    """The sum check begun at ``at`` ([pipeline, stage]): its two rounds (step 3), each waiting for the other
    members', its own work between them (sketches, norms, digests); when each member is done."""
    for phase, gb in enumerate(obj.profile.verify_gb):
        at = _group_exchange(obj, run.sigma, at, gb, run.access)
        if phase == 0:
            at = at + obj.verify_compute_s[None, :]
    return at


def _reveal(obj: SimulatedObjective, sigma: np.ndarray, start: np.ndarray, free_g: np.ndarray,
            access: Access | None) -> np.ndarray:
    """The recompute check's reveals at the step's ``start`` ([pipeline, stage]): member i of every group sends
    its ``reveal_gb`` to its verifier, member i + 1 mod D (the runtime rotates by 1 + σ, σ drawn each step:
    priced as σ = 0, the only rotation with two replicas). Without access links it takes the pair's FIFO
    (``free_g`` [stage, src, dst]) and delays the all-reduce only if still on it when the shards go; with them
    ``Access.reveal`` queues it on the sender's uplink and the receiver's downlink too. Nothing waits for its
    delivery. Returns the pairs' free times."""
    d = obj.num_replicas
    rows, verifier = np.arange(d), (np.arange(d) + 1) % d
    if access is not None:
        for j in np.flatnonzero(obj.reveal_gb):
            access.reveal(j, rows, verifier, obj.reveal_gb[j], start[:, j])
        return free_g
    free_g = free_g.copy()
    for j in np.flatnonzero(obj.reveal_gb):
        a, b = sigma[:, j], sigma[verifier, j]
        free_g[j, rows, verifier] = np.maximum(start[:, j], free_g[j, rows, verifier]) + obj.reveal_gb[j] * obj.s_per_gb[a, b]
    return free_g


def _group_exchange(obj: SimulatedObjective, sigma: np.ndarray, at: np.ndarray, gb: float,
                    access: Access | None) -> np.ndarray:
    """Every member of every stage's group ([pipeline, stage] ``at``) sends each other member one message of
    ``gb`` GB, in rank order (``verify.sum_check``), and waits for theirs: when each has them all. Over access
    links a message waits for its sender's uplink and then the receiver's downlink (served in the order the
    senders are taken: exact with two replicas); without, its pair is free (the all-reduce's sends are
    taken)."""
    if gb <= 0:
        return at
    got = at.copy()
    d = obj.num_replicas
    for i in range(d):
        for k in range(d):
            if k == i:
                continue
            a, b = sigma[i], sigma[k]  # [stage]: sender, receiver
            if access is None:
                got[k] = np.maximum(got[k], at[i] + obj.delay_s[a, b] + gb * obj.s_per_gb[a, b])
                continue
            start = np.maximum(at[i], access.up_free[i])
            access.up_free[i] = np.where(obj.has_up[a], start + gb * obj.up_s_per_gb[a], -np.inf)
            first = start + obj.delay_s[a, b]
            through = np.maximum(first, access.down_free[k]) + gb * obj.down_s_per_gb[b]
            access.down_free[k] = np.where(obj.has_down[b], through, -np.inf)
            got[k] = np.maximum(got[k], np.maximum(first + gb * obj.send_s_per_gb[a, b], access.down_free[k]))
    return got


def _all_reduce(obj: SimulatedObjective, last_start: np.ndarray, bwd: np.ndarray, backward_done: np.ndarray,
                free_g: np.ndarray, ser_g: np.ndarray, lat_g: np.ndarray, overlap: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
    """When each stage's member ([j, i]) has its gradients all-reduced and its own sends taken, and the links'
    free times after. Per bucket, each member sends the bucket's shard to its owner (reduce-scatter) and the
    owner, once it has every shard, the reduced shard to every member (all-gather). Without overlap one
    bucket starts when the backward pass is done; with it each bucket of stage 0 starts when the last backward
    pass has produced it, a later stage's when the pass is done (``bucket_shares``: full buckets first, the remainder last, the gradients made evenly through
    the pass). Each link serves its messages first come, first served (FIFO
    by hand-over time, as the runtime's few buckets in flight hand them over): an all-gather's hand-over
    depends on other links' reduce-scatters, so the order is found by iterating to a fixed point from the
    reduce-scatters alone (``ALL_REDUCE_ROUNDS`` at most; one bucket settles in two). A stage with fewer buckets
    than another has padding buckets: never ready, nothing sent. ``overlap`` False: every bucket at
    ``backward_done`` whatever the profile (a DiLoCo round's end)."""
    k_all = obj.buckets
    off = ~np.eye(obj.num_replicas, dtype=bool)[None, :, :, None]
    valid = obj.bucket_share > 0  # [j, k]
    if obj.overlap and overlap:
        ready = last_start[..., None] + obj.bucket_ready[:, None, :] * bwd[..., None]  # [j, i, k]
        ready[1:] = np.maximum(ready[1:], backward_done[1:, :, None])  # held until the input's gradient is sent
    else:
        ready = np.repeat(backward_done[..., None], k_all, axis=-1)
    ready = np.where(valid[:, None, :], ready, -np.inf)
    shape = ser_g.shape  # [j, src, dst, k]
    handed_rs = np.broadcast_to((ready + obj.rs_encode_s[:, None, :])[:, :, None, :], shape)
    ser_all = np.concatenate([ser_g, ser_g], axis=-1)
    sent = np.broadcast_to(np.concatenate([valid, valid], axis=-1)[:, None, None, :], ser_all.shape) & off
    reduced = ready
    for _ in range(ALL_REDUCE_ROUNDS):
        encoded = reduced + obj.ag_encode_s[:, None, :]  # [j, owner, k]: the sum encoded (and its own copy decoded)
        handed = np.concatenate([handed_rs, np.broadcast_to(encoded[:, :, None, :], shape)], axis=-1)
        order = np.argsort(handed, axis=-1, kind="stable")
        in_order = np.take_along_axis(handed, order, axis=-1)
        ser_in_order = np.take_along_axis(ser_all, order, axis=-1)
        finished, free = np.empty_like(in_order), free_g
        for n in range(2 * k_all):
            free = np.maximum(in_order[..., n], free) + ser_in_order[..., n]  # a padding message: -inf + 0
            finished[..., n] = free
        arrive = np.empty_like(finished)
        np.put_along_axis(arrive, order, finished + lat_g[..., None], axis=-1)
        arrive = np.where(sent, arrive, -np.inf)
        # [j, owner, k]: every shard of k is in and decoded
        settled = np.maximum(ready, arrive[..., :k_all].max(axis=1) + obj.rs_decode_s[:, None, :])
        if np.array_equal(settled, reduced):
            break
        reduced = settled
    encoded = reduced + obj.ag_encode_s[:, None, :]
    gathered = np.maximum(encoded, arrive[..., k_all:].max(axis=1) + obj.ag_decode_s[:, None, :])  # [j, i, k]
    sends_taken = arrive.max(axis=(2, 3))
    return np.maximum(backward_done, np.maximum(gathered.max(axis=-1), sends_taken)), free
