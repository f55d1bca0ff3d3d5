"""The ``simulated`` objective: the step time of what the runtime really does, not just its traffic.

The paper's cost (``cost.DtfmObjective``) adds communication only: every hop carries a whole shard's
activations as one message, one boundary after another, and every all-reduce exchanges its shards with one
peer after another. Our runtime (``runtime/executor.py``, ``runtime/allreduce.py``) and the link emulator
(``net/transport/emulation.py``) do something else, and this module predicts it. Units: the cluster's (α in ms, β in
Gbit/s, volumes in GB) and the network's seconds; ``StepProfile`` holds what is not communication.

What one step does, on the device holding stage j of pipeline i (M micro-batches, S stages, D pipelines):

1. forward, m = 0 … M−1: wait for micro-batch m's activations from stage j−1 (stage 0 has its tokens),
   compute F_j, send the output to stage j+1 without waiting (the send is queued on the link);
2. backward, m = M−1 … 0: wait for the gradient of micro-batch m from stage j+1 (the last stage has its
   loss), compute B_j, send the input's gradient to stage j−1 without waiting;
3. all-reduce of the stage's g_j GB of gradients in its group of D: send the 1/D shard that member k owns
   to every member k (all at once, one message per link), wait for the D−1 shards of ours, add, send the
   reduced shard to every member, wait for theirs and for our own sends to be taken; then the optimizer
   step U_j; then the step ends once every send of the step was taken.
With DiLoCo (``sync_every`` H > 1, ``model.outer``) step 3 happens once a round: the all-reduce of the
pseudo-gradients after every H-th step, none after the others. The prediction is the period of steps without
it plus 1/H of what it adds to a step that has it (both simulated); the closed form divides the groups'
all-reduce term by H.

4. with gradient clipping (``clip``, ``model.clip``), between the all-reduce and the update: send the
   stage's squared norm to every other stage of the pipeline (one scalar: latency and message overhead
   only, α + o) and wait for theirs. The last stages are done first, so this mostly costs the stages after
   0 the latency from stage 0, while they would wait for its next activations anyway.

The run's settings (``StepProfile``, ``wire_model``): the wire format scales what each kind of message
carries (activations, their gradients, the all-reduce's shards); steps 1 and 2 run in the schedule's order
(``gpipe`` as above; ``1f1b`` interleaves them, each stage in its own order, ``wire_model.step_order``);
with overlap, step 3 runs bucket by bucket, each bucket starting once the last backward pass produced it.

A device starts step t+1 ``boundary_s`` after it ended step t (what the agent does between steps: its
heartbeat, reading the run's records). Step t's time is when its last device ended it minus when the last
device ended step t−1 (the swarm's measured step time, which is the period in steady state).

Links, as the emulator shapes them: the directed link a→b is a FIFO. A message of x GB handed to it at
time t starts at max(t, when the link is free), occupies it 8x/β_ab (bandwidth serialises) and arrives
α_ab + o later, o being the transport's own per-message overhead (latency overlaps with the next
message's serialisation). Different destinations are different FIFOs: a device's D−1 shard messages
travel in parallel — unlike the paper's model, which sums them.

``evaluate`` is this event simulation, exactly (``simulate``): ``steps`` steps from a common start,
vectorised over pipelines and groups (O(steps · M · S) numpy operations), and the prediction is the
period of the step times after the first (the measured one skips the warm-up step too), ``step_period``:
the median of the means of each two consecutive steps, the statistic the e2e benchmark measures. Steps
often alternate long and short (with 2 micro-batches the stages end their steps in turn; on the emulated
world-wide network 2.48 s and 2.12 s), and the median of single steps would pick whichever is more
frequent, here the short one: 2.12 s predicted for a 2.30 s period.

The search needs the decomposition of ``cost.Objective``: group values, bottleneck hop values, a
non-decreasing ``combine``. The closed form below has it; it estimates the simulation from above, loosely
where pipelines are unlike each other (on random symmetric clusters it is 0.97–2.3 times the simulated
step, median 1.11; ``Σ_hops max_pipelines`` ≥ ``max_pipelines Σ_hops`` is most of the gap). The search
optimises it; then ``refine`` puts the groups in the stage order the simulation likes best (the closed
form cannot see positions, see below) and the plan is evaluated exactly.

- A pipeline's forward pass is a flow shop of M identical jobs through the resources F_0, link 0→1, F_1,
  …, F_{S−1} (a link's resource time is its serialisation τ; its latency α + o is a pure delay). For
  identical jobs the makespan is Σ resource times + Σ delays + (M−1) · max resource time: the longest
  path through the M × resources grid stays on the slowest resource for the M−1 extra jobs. The
  backward pass is the same flow shop in reverse, starting when the last stage finished its forward.
  With a hop's value h = (α+o+τ)_{a→b} + (α+o+τ)_{b→a} (one micro-batch there and back, τ = 8·c_PP/(M·β)),
  bottlenecked over pipelines like the paper's, and C_j = F_j + B_j:
      FB = Σ_j C_j + Σ_hops h + (M−1) · max(max_j C_j, max_hops h)
  (the bottleneck term uses a hop's whole value, latency included, for both directions: an upper bound
  with symmetric links, tight when serialisation dominates, as it does in the paper's regime).
- An all-reduce that starts together finishes by max over paths i → r → k of (α+o+8·s/β)_{ir} +
  (α+o+8·s/β)_{rk} (a shard to its owner r, the reduced shard from r), s = g/D. Member d's term
      max_r (α+o+8s/β)_{r→d} + max_r (α+o+8s/β)_{d→r}
  bounds every such path through d, so the group's value is the max of its members' terms. g is the
  largest stage's gradients (``group_terms`` does not know the stage), so it is an upper bound too.
- ``combine`` = FB + max_j (group value_j + U_j) + boundary: the pipeline, then the slowest group's
  all-reduce and update, then the pause between steps. In steady state a step is the slowest cycle
  "stage j's forward → the last stage → back to stage j → stage j's all-reduce → its next step" (a max-plus
  cycle), so the position of a group matters: stage j's all-reduce overlaps the backward pass of stages
  j−1 … 0. ``combine`` charges every group as if it were at stage 0 (an upper bound that keeps the form
  "groups, then a sum of hops" the exhaustive solver relies on); ``refine`` then chooses the positions.
  Clipping adds the longest scalar delay of the cluster (an upper bound that is the same for every plan:
  the closed form does not see which stages a pipeline pairs; the simulation does).

Compute times are for a device of ``reference_tflops``; a device whose ``tflops`` is known computes
reference/tflops times as long (the closed form uses the slowest device for every stage).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import GBIT_PER_GB, CostBreakdown, check_assignment, replicas_of
from p2ptrain.planning.matching import bottleneck_matching
from p2ptrain.planning.wire_model import BACKWARD, SCHEDULES, WIRE_BYTES, step_order, wire_factors
from p2ptrain.planning.workload import Workload

DEFAULT_STEPS = 4  # simulated steps; the first is left out of the median, as in measurements
MAX_PERMUTED_STAGES = 6  # ``refine`` tries every stage order up to this many stages (720 simulations)
MAX_REFINE_EVALUATIONS = 400  # beyond, at most this many simulations of exchanged positions
REL_GAIN = 1e-9  # a new order must be better than this, relatively, to replace the current one
MATCHING_SOFTNESS = 0.01  # tie-breaking temperature of the bottleneck matchings, as a fraction of a hop
MAX_SIMULATED_BUCKETS = 8  # an overlapped all-reduce is simulated in at most this many (merged) buckets
ALL_REDUCE_ROUNDS = 6  # fixed-point rounds of the all-reduce's link order (``_all_reduce``)


@dataclass(frozen=True)
class StepProfile:
    """What a step does besides moving bytes, in the network's seconds (see the module docstring).

    Per-stage tuples have one entry per stage, or are empty (no compute; every stage all-reduces the
    workload's ``gradient_gb``). ``forward_s``/``backward_s``: one micro-batch on a device of
    ``reference_tflops`` (None: every device alike). ``update_s``: flattening gradients and the optimizer
    step. ``message_s``: the transport's overhead per message, added to every message's latency.
    ``boundary_s``: what a device does between two steps.

    What the runtime's settings change (``wire_model``): ``wire`` scales each tensor kind's volume by its
    bytes on the wire over ``volume_bytes`` (the bytes per element the workload's c_PP and c_DP count:
    activations, their gradients, data-parallel gradients; "" leaves the volumes as they are);
    ``schedule`` is the order of a stage's forwards and backwards; ``bucket_gb`` > 0 all-reduces the
    gradients in buckets of that many GB (the workload's units, before the wire) started during the last
    backward pass (overlap), 0 in one exchange after it.
    """

    micro_batches: int = 1
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    update_s: tuple[float, ...] = ()
    gradient_gb: tuple[float, ...] = ()
    message_s: float = 0.0
    boundary_s: float = 0.0
    reference_tflops: float | None = None
    steps: int = DEFAULT_STEPS
    wire: str = ""
    volume_bytes: tuple[float, float, float] = (4.0, 4.0, 4.0)
    schedule: str = "gpipe"
    bucket_gb: float = 0.0
    clip: bool = False  # the stages exchange their gradient norms before the update (step 4)
    sync_every: int = 1  # DiLoCo: the replicas all-reduce once every this many steps (1: every step)

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"step profile: micro_batches must be a positive integer, got {self.micro_batches!r}")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"step profile: steps must be an integer of at least 2, got {self.steps!r}")
        for name in ("forward_s", "backward_s", "update_s", "gradient_gb"):
            values = tuple(float(v) for v in getattr(self, name))
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"step profile: {name} must hold non-negative numbers, got {values}")
            object.__setattr__(self, name, values)
        for name in ("message_s", "boundary_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"step profile: {name} must be a non-negative number, got {value!r}")
        ref = self.reference_tflops
        if ref is not None and not (math.isfinite(ref) and ref > 0):
            raise ValueError(f"step profile: reference_tflops must be positive, got {ref!r}")
        if self.wire and self.wire not in WIRE_BYTES:
            raise ValueError(f"step profile: unknown wire format {self.wire!r} (known: {', '.join(WIRE_BYTES)})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"step profile: unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})")
        volume = tuple(float(v) for v in self.volume_bytes)
        if len(volume) != 3 or any(not (math.isfinite(v) and v > 0) for v in volume):
            raise ValueError(f"step profile: volume_bytes must be three positive numbers, got {self.volume_bytes!r}")
        object.__setattr__(self, "volume_bytes", volume)
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"step profile: sync_every must be a positive integer, got {self.sync_every!r}")
        if not (math.isfinite(self.bucket_gb) and self.bucket_gb >= 0):
            raise ValueError(f"step profile: bucket_gb must be a non-negative number, got {self.bucket_gb!r}")

    @property
    def factors(self) -> tuple[float, float, float]:
        """Each kind's volume on the wire over the workload's: activations, their gradients, DP gradients."""
        return wire_factors(self.wire, self.volume_bytes) if self.wire else (1.0, 1.0, 1.0)

    def per_stage(self, name: str, num_stages: int, default: float) -> np.ndarray:
        """The per-stage tuple ``name`` as an array of ``num_stages`` (``default`` everywhere when empty)."""
        values = getattr(self, name)
        if not values:
            return np.full(num_stages, float(default))
        if len(values) != num_stages:
            raise ValueError(f"step profile: {name} has {len(values)} entries for {num_stages} stages")
        return np.array(values, dtype=float)

    def scaled(self, factor: float) -> StepProfile:
        """The same profile with every time multiplied by ``factor`` (e.g. real seconds → network seconds)."""
        return dataclasses.replace(
            self,
            forward_s=tuple(v * factor for v in self.forward_s),
            backward_s=tuple(v * factor for v in self.backward_s),
            update_s=tuple(v * factor for v in self.update_s),
            message_s=self.message_s * factor,
            boundary_s=self.boundary_s * factor,
        )


@dataclass(frozen=True)
class StepWorkload(Workload):
    """A workload (c_PP, c_DP) with the step profile the ``simulated`` objective needs."""

    step: StepProfile = field(default_factory=StepProfile)


@dataclass(frozen=True)
class SimulatedSteps:
    """The event simulation of an assignment: each step's time (from when the last device ended the step
    before to when the last device ends this one), and the split of the prediction at the device that ends
    the last step: its forward/backward part, and the rest (all-reduce, update, the pause between steps)."""

    step_s: tuple[float, ...]
    pipeline_s: float
    data_parallel_s: float
    sync_every: int = 1  # DiLoCo: ``step_s`` are steps without the all-reduce, one in this many has it ...
    sync_extra_s: float = 0.0  # ... and takes this much longer

    @property
    def predicted_s(self) -> float:
        """The period of the steps after the first (warm-up) one (``step_period``); DiLoCo: plus the round's
        all-reduce spread over its steps."""
        return step_period(self.step_s[1:]) + self.sync_extra_s / self.sync_every


class SimulatedObjective:
    """Step time of GPipe + sharded all-reduce over per-link FIFOs (module docstring)."""

    name = "simulated"

    def __init__(self, cluster: Cluster, workload: Workload, num_stages: int):
        n = cluster.num_devices
        d = replicas_of(n, num_stages)
        profile = workload.step if isinstance(workload, StepWorkload) else StepProfile()
        self.profile = profile
        self.num_stages = s = num_stages
        self.num_replicas = d
        self.micro_batches = m = profile.micro_batches
        off = ~np.eye(n, dtype=bool)
        # seconds a message takes to arrive after it starts (α + o), and seconds per GB on the link (8/β)
        self.delay_s = np.where(off, cluster.latency_ms / 1000.0 + profile.message_s, 0.0)
        with np.errstate(divide="ignore"):
            self.s_per_gb = np.where(off, GBIT_PER_GB / np.where(off, cluster.bandwidth_gbps, 1.0), 0.0)
        act_factor, grad_factor, dp_factor = profile.factors
        self.activation_gb = workload.activation_gb / m * act_factor  # one micro-batch's activations, as sent
        self.activation_grad_gb = workload.activation_gb / m * grad_factor  # ... and their gradients
        self.gradient_gb = profile.per_stage("gradient_gb", s, workload.gradient_gb) * dp_factor
        workload_gradient_gb = self.gradient_gb / dp_factor if dp_factor else self.gradient_gb
        shares = bucket_shares(workload_gradient_gb, profile.bucket_gb)
        self.buckets = shares.shape[1]
        self.bucket_share = shares  # [stage, bucket]: the bucket's part of the stage's gradients (0: no bucket)
        self.bucket_ready = np.cumsum(shares, axis=1)  # ... how far through the last backward it is ready
        self.overlap = profile.bucket_gb > 0
        self.order = step_order(profile.schedule, s, m)
        self.forward_s = profile.per_stage("forward_s", s, 0.0)
        self.backward_s = profile.per_stage("backward_s", s, 0.0)
        self.update_s = profile.per_stage("update_s", s, 0.0)
        self.slowdown = _slowdown(cluster, profile.reference_tflops)
        forward = self.delay_s + self.activation_gb * self.s_per_gb
        backward = self.delay_s + self.activation_grad_gb * self.s_per_gb
        hop = forward + backward.T
        hop = (hop + hop.T) / 2  # symmetric (it is already when links are; only formats differ by direction)
        np.fill_diagonal(hop, 0.0)
        hop.setflags(write=False)
        self.hop_link_s = hop
        self._pair_dp_s = np.where(off, self.delay_s + self.gradient_gb.max() / d * self.s_per_gb, 0.0)
        worst = float(self.slowdown.max())
        self._compute_s = (self.forward_s + self.backward_s) * worst
        self._update_s = self.update_s * worst
        self._clip_s = float(self.delay_s.max()) if profile.clip and s > 1 else 0.0
        links = hop[~np.eye(n, dtype=bool)]
        self._tau = MATCHING_SOFTNESS * (float(np.median(links)) if links.size else 1.0) or 1.0

    # -- the closed form the search optimises ---------------------------------------------------------------

    def group_terms(self, members: np.ndarray) -> np.ndarray:
        sub = self._pair_dp_s[np.ix_(members, members)]  # sub[i, k]: member i → member k
        return sub.max(axis=0) + sub.max(axis=1)

    def combine(self, group_values: Sequence[float], hop_values: Sequence[float]) -> CostBreakdown:
        compute = self._compute_s
        hops = [float(h) for h in hop_values]
        bottleneck = max(float(compute.max()), max(hops, default=0.0))
        pipeline = float(compute.sum()) + sum(hops) + (self.micro_batches - 1) * bottleneck
        h = self.profile.sync_every  # DiLoCo: one all-reduce a round
        data_parallel = max(float(g) / h + float(u) for g, u in zip(group_values, self._update_s, strict=True))
        data_parallel += self.profile.boundary_s + self._clip_s
        return CostBreakdown(cost_s=pipeline + data_parallel, data_parallel_s=data_parallel, pipeline_s=pipeline)

    # -- the stage order, under the exact simulation ---------------------------------------------------------

    def refine(self, assignment: np.ndarray) -> np.ndarray:
        """The assignment's stage groups in the stage order the simulation likes best (pipelines re-matched).

        The closed form does not see where a group sits, the simulation does: a slow all-reduce late in
        the pipeline overlaps the backward pass still running through the earlier stages, one at stage 0
        does not (on the "spot" network of 8 devices, Megatron's order is 1.4 times faster than its mirror). So
        the search's groups are put in their best order: every order up to ``MAX_PERMUTED_STAGES`` stages,
        beyond that the mirror image and pairwise exchanges of positions, first improvement, at most
        ``MAX_REFINE_EVALUATIONS`` simulations.
        """
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        s = self.num_stages
        if s == 1:
            return sigma
        groups = [sigma[:, j] for j in range(s)]
        best_order, best = tuple(range(s)), self.simulate(sigma).predicted_s
        if s <= MAX_PERMUTED_STAGES:
            for order in itertools.permutations(range(s)):
                cost = self.simulate(self._chain(groups, order)).predicted_s
                if cost < best * (1 - REL_GAIN):
                    best_order, best = order, cost
            return self._chain(groups, best_order) if best_order != tuple(range(s)) else sigma
        evaluations, improved = 0, True
        candidates = [tuple(reversed(best_order))]
        while improved and evaluations < MAX_REFINE_EVALUATIONS:
            improved = False
            for order in candidates:
                evaluations += 1
                cost = self.simulate(self._chain(groups, order)).predicted_s
                if cost < best * (1 - REL_GAIN):
                    best_order, best, improved = order, cost, True
                    break
            candidates = [_swapped(best_order, a, b) for a in range(s) for b in range(a + 1, s)]
        return self._chain(groups, best_order) if best_order != tuple(range(s)) else sigma

    def _chain(self, groups: list[np.ndarray], order: Sequence[int]) -> np.ndarray:
        """Pipelines through ``groups`` in ``order``: one bottleneck matching of ``hop_link_s`` per hop."""
        current = groups[order[0]]
        columns = [current]
        for g in order[1:]:
            nxt = groups[g]
            _, _, cols = bottleneck_matching(self.hop_link_s[np.ix_(current, nxt)], self._tau)
            current = nxt[cols]
            columns.append(current)
        return np.stack(columns, axis=1)

    # -- the exact event simulation -------------------------------------------------------------------------

    def evaluate(self, assignment: np.ndarray) -> CostBreakdown:
        sim = self.simulate(assignment)
        return CostBreakdown(cost_s=sim.predicted_s, data_parallel_s=sim.data_parallel_s, pipeline_s=sim.pipeline_s)

    def simulate(self, assignment: np.ndarray, steps: int | None = None) -> SimulatedSteps:
        """Run ``steps`` (default: the profile's) steps of ``assignment`` through the event model."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        synced = _simulate(self, sigma, steps or self.profile.steps)
        h = self.profile.sync_every
        if h == 1 or self.num_replicas == 1:
            return synced
        local = _simulate(self, sigma, steps or self.profile.steps, all_reduce=False)
        extra = max(0.0, synced.predicted_s - local.predicted_s)
        return dataclasses.replace(local, data_parallel_s=local.data_parallel_s + extra / h, sync_every=h,
                                   sync_extra_s=extra)


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


def _swapped(order: tuple[int, ...], a: int, b: int) -> tuple[int, ...]:
    out = list(order)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _slowdown(cluster: Cluster, reference_tflops: float | None) -> np.ndarray:
    """Per device: how many times longer than the reference device it computes (1 when unknown)."""
    if reference_tflops is None:
        return np.ones(cluster.num_devices)
    return np.array([reference_tflops / d.tflops if d.tflops else 1.0 for d in cluster.devices])


def _simulate(obj: SimulatedObjective, sigma: np.ndarray, steps: int, all_reduce: bool = True) -> SimulatedSteps:
    d, s, m = obj.num_replicas, obj.num_stages, obj.micro_batches
    a, b = sigma[:, :-1], sigma[:, 1:]  # pipeline i's hop h: a[i, h] → b[i, h]
    lat_f, ser_f = obj.delay_s[a, b], obj.activation_gb * obj.s_per_gb[a, b]
    lat_b, ser_b = obj.delay_s[b, a], obj.activation_grad_gb * obj.s_per_gb[b, a]
    cols = sigma.T  # cols[j, i]: stage j's member of pipeline i
    src, dst = cols[:, :, None], cols[:, None, :]
    lat_g = obj.delay_s[src, dst]  # [j, i, k]: link from member i to member k of stage j's group
    shard_gb = obj.gradient_gb[:, None] * obj.bucket_share / d  # [j, k]: one bucket's shard
    ser_g = shard_gb[:, None, None, :] * obj.s_per_gb[src, dst][..., None]  # [j, i, r, k]
    slow = obj.slowdown[sigma]
    fwd, bwd, upd = obj.forward_s * slow, obj.backward_s * slow, obj.update_s * slow
    last_backward = {j: max(k for k, (kind, jj, _) in enumerate(obj.order) if kind == BACKWARD and jj == j)
                     for j in range(s)}
    free_f = np.full((d, s - 1), -np.inf)  # when each link is free again (FIFO), kept across steps
    free_b = np.full((d, s - 1), -np.inf)
    free_g = np.full((s, d, d), -np.inf)
    start = np.zeros((d, s))
    step_s: list[float] = []
    completed = pipeline_s = 0.0
    for _ in range(steps):
        busy = start.copy()  # when each device is done with what it computed so far
        sent = start.copy()  # when each device's last pipeline message arrived
        arrive_f = np.zeros((d, s, m))  # when micro-batch mb's activations reach stage j
        arrive_b = np.zeros((d, s, m))  # ... and its gradient
        last_start = start.copy()  # when each device began its last backward pass
        for k, (kind, j, mb) in enumerate(obj.order):  # each stage's own order (``wire_model.step_order``)
            if kind != BACKWARD:
                busy[:, j] = (busy[:, j] if j == 0 else np.maximum(busy[:, j], arrive_f[:, j, mb])) + fwd[:, j]
                if j < s - 1:
                    free_f[:, j] = np.maximum(busy[:, j], free_f[:, j]) + ser_f[:, j]
                    arrive_f[:, j + 1, mb] = free_f[:, j] + lat_f[:, j]
                    sent[:, j] = np.maximum(sent[:, j], arrive_f[:, j + 1, mb])
                continue
            ready = busy[:, j] if j == s - 1 else np.maximum(busy[:, j], arrive_b[:, j, mb])
            if k == last_backward[j]:
                last_start[:, j] = ready
            busy[:, j] = ready + bwd[:, j]
            if j > 0:
                free_b[:, j - 1] = np.maximum(busy[:, j], free_b[:, j - 1]) + ser_b[:, j - 1]
                arrive_b[:, j - 1, mb] = free_b[:, j - 1] + lat_b[:, j - 1]
                sent[:, j] = np.maximum(sent[:, j], arrive_b[:, j - 1, mb])
        backward_done = busy.T  # [j, i]
        all_reduced = backward_done
        if d > 1 and all_reduce:
            all_reduced, free_g = _all_reduce(obj, last_start.T, bwd.T, backward_done, free_g, ser_g, lat_g)
        reduced = all_reduced.T  # [i, j]
        if obj.profile.clip and s > 1:  # every other stage's norm (the diagonal's delay is 0: its own)
            reduced = (reduced[:, :, None] + obj.delay_s[sigma[:, :, None], sigma[:, None, :]]).max(axis=1)
        end = np.maximum(reduced + upd, sent)
        crit = np.unravel_index(int(np.argmax(end)), end.shape)  # the device that ends the step last
        pipeline_s = float(busy[crit] - start[crit])
        step_s.append(float(end[crit]) - completed)
        completed = float(end[crit])
        start = end + obj.profile.boundary_s
    predicted = step_period(step_s[1:])  # ``SimulatedSteps.predicted_s``
    return SimulatedSteps(step_s=tuple(step_s), pipeline_s=pipeline_s, data_parallel_s=predicted - pipeline_s)


def _all_reduce(obj: SimulatedObjective, last_start: np.ndarray, bwd: np.ndarray, backward_done: np.ndarray,
                free_g: np.ndarray, ser_g: np.ndarray, lat_g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """When each stage's member ([j, i]) has its gradients all-reduced and its own sends taken, and the links'
    free times after. Per bucket, each member sends the bucket's shard to its owner (reduce-scatter) and the
    owner, once it has every shard, the reduced shard to every member (all-gather). Without overlap one
    bucket starts when the backward pass is done; with it each bucket starts when the last backward pass has
    produced it (``bucket_shares``: full buckets first, the remainder last, the gradients made evenly through
    the pass). Each link serves its messages first come, first served (FIFO
    by hand-over time, as the runtime's few buckets in flight hand them over): an all-gather's hand-over
    depends on other links' reduce-scatters, so the order is found by iterating to a fixed point from the
    reduce-scatters alone (``ALL_REDUCE_ROUNDS`` at most; one bucket settles in two). A stage with fewer buckets
    than another has padding buckets: never ready, nothing sent."""
    k_all = obj.buckets
    off = ~np.eye(obj.num_replicas, dtype=bool)[None, :, :, None]
    valid = obj.bucket_share > 0  # [j, k]
    if obj.overlap:
        ready = last_start[..., None] + obj.bucket_ready[:, None, :] * bwd[..., None]  # [j, i, k]
    else:
        ready = np.repeat(backward_done[..., None], k_all, axis=-1)
    ready = np.where(valid[:, None, :], ready, -np.inf)
    shape = ser_g.shape  # [j, src, dst, k]
    handed_rs = np.broadcast_to(ready[:, :, None, :], shape)
    ser_all = np.concatenate([ser_g, ser_g], axis=-1)
    sent = np.broadcast_to(np.concatenate([valid, valid], axis=-1)[:, None, None, :], ser_all.shape) & off
    reduced = ready
    for _ in range(ALL_REDUCE_ROUNDS):
        handed = np.concatenate([handed_rs, np.broadcast_to(reduced[:, :, None, :], shape)], axis=-1)
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
        settled = np.maximum(ready, arrive[..., :k_all].max(axis=1))  # [j, owner, k]: every shard of k is in
        if np.array_equal(settled, reduced):
            break
        reduced = settled
    gathered = np.maximum(reduced, arrive[..., k_all:].max(axis=1))  # [j, i, k]
    sends_taken = arrive.max(axis=(2, 3))
    return np.maximum(backward_done, np.maximum(gathered.max(axis=-1), sends_taken)), free
