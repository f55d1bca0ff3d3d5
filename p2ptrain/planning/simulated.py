"""The ``simulated`` objective: the step time of what the runtime really does, not just its traffic.

The paper's cost (``cost.DtfmObjective``) adds communication only: every hop carries a whole shard's
activations as one message, one boundary after another, and every all-reduce exchanges its shards with one
peer after another. Our runtime (``runtime/executor.py``, ``runtime/allreduce.py``) and the link emulator
(``net/transport/emulation.py``) do something else, and this module predicts it. Units: the cluster's (α in ms, β in
Gbit/s, volumes in GB) and the network's seconds; ``StepProfile`` holds what is not communication.

What one step does, on the device holding stage j of pipeline i (M micro-batches, S stages, D pipelines):

1. forward, m = 0 … M−1: wait for micro-batch m's activations from stage j−1 (stage 0 has its tokens),
   compute F_j, send the output to stage j+1 without waiting (the send is queued on the link); with the
   recompute check (``recompute_rate`` ρ, ``verify.recompute_check``, run in the shadow of the next step) the step
   first hands the member's verifier its reveal of the step before: the pipeline messages of ⌈ρ·M⌉ challenged
   micro-batches (not the mean ρ·M: a step waits for its slowest pipeline, and with a few members one of them
   is challenged in most steps, 90 % of them with 8 members at ρ·M = 1/4; measured on home uplinks, such a
   step took 1.4 times one without) as they travelled (wire format; per micro-batch the activation received and the
   gradient sent where j > 0, the activation sent and the gradient received where j < S−1), ahead of the
   step's pipeline sends on its uplink, or on the pair's link (idle in the forward phase) without one;
2. backward, m = M−1 … 0: wait for the gradient of micro-batch m from stage j+1 (the last stage has its
   loss), compute B_j, send the input's gradient to stage j−1 without waiting. With the recompute check each
   F_j and B_j takes 1 + ρ times as long: the member recomputes, as a verifier, ρ·M micro-batches of another
   replica of its stage a step (the rotation is a bijection), in a background thread on the same device,
   spread over the step;
3. all-reduce of the stage's g_j GB of gradients in its group of D: send the 1/D shard that member k owns
   to every member k (all at once, one message per link), wait for the D−1 shards of ours, add, send the
   reduced shard to every member, wait for theirs and for our own sends to be taken; with the sum check
   (``verify_gb``, ``verify.sum_check``: every step, with replicas) two more rounds in the group, each a message
   to every other member (a signed commit, then the sketches) and a wait for theirs; the recompute check's
   result is joined there too, its reveal and recompute long done (not a wait); then the optimizer
   step U_j; then the step ends once every send of the step was taken. (The checks' CPU, signing and
   sketching, is not priced: about 0.1 s a step on 4 agents sharing 2 cores; nor are the recompute check's
   commitments, 512 + 32 bytes a pipeline message each, whose round is over before the reveal is needed.)
With DiLoCo (``sync_every`` H > 1, ``model.outer``) step 3 happens once a round: the all-reduce of the
pseudo-gradients after every H-th step, none after the others, and where the runtime runs it
(``executor.StageExecutor._outer_step``): after the clip's exchange (step 4) and the update, every bucket at once, so a
later stage's all-reduce does not overlap the backward passes of the stages before it (with clipping it
starts when stage 0's norm is in). The prediction is the period of steps without it plus 1/H of what it adds
to a step that has it (both simulated); the closed form divides the groups' all-reduce term by H.

With ``sync_overlap`` (``[train.diloco] overlap``) the round's all-reduce runs streamed during the next
round's first τ steps instead (``overlap_steps``, at most H): each of them is priced as the longer of the
step without it (simulated) and, for every queue (each device's uplink and downlink; each pair's path, which
is the only queue where a device has no access link), the time the queue needs for one step's bytes plus
1/τ of the round's all-reduce bytes (``streamed_floor_s``): the busiest queue paces those steps, however
the shards are scheduled in it; the round's other H − τ steps are the step without it. With F fragments
(``fragments``, Streaming DiLoCo's: rounds of 1/F of the parameters staggered by H / F steps) each carries 1/F
of the bytes over its own τ steps: the round's bytes spread over τ · F steps (at most H).

4. with gradient clipping (``clip``, ``model.clip``), between the all-reduce and the update: send the
   stage's squared norm to every other stage of the pipeline (one scalar: latency and message overhead
   only, α + o) and wait for theirs. The last stages are done first, so this mostly costs the stages after
   0 the latency from stage 0, while they would wait for its next activations anyway. Behind an uplink a
   scalar waits for the sender's queue to empty (without an all-reduce, its last gradient may still be
   on it); not for a downlink's: it adds no bytes, and its receiver has emptied its own downlink of the
   step's messages before it needs the scalar (its own all-reduce is done).

The run's settings (``StepProfile``, ``wire_model``): the wire format scales what each kind of message
carries (activations, their gradients, the all-reduce's shards); steps 1 and 2 run in the schedule's order
(``gpipe`` as above; ``1f1b`` interleaves them, each stage in its own order, ``wire_model.step_order``);
with overlap, step 3 runs bucket by bucket, each bucket of stage 0 starting once the last backward pass
produced it; a later stage's buckets start once that pass is done and its input's gradient is handed over
(``runtime.buckets`` holds them: that gradient is what the stage before waits for).

Codecs (``StepProfile.encode_s_per_gb``/``decode_s_per_gb``, which the calibration measures for the run's
wire): the CPU time of turning tensors into messages and back, which the wire's bytes do not show (int2's
encoder tries five steps a block). With e and d a kind's encode and decode seconds per GB, where the runtime
spends it:

- activations and their gradients, x GB a micro-batch, on the compute thread (``runtime/executor.py``): stage
  j decodes the activations it receives before its forward and encodes its output after it (F_j grows by
  d·x where j > 0, e·x where j < S−1); it decodes the gradient it receives before its backward (j < S−1)
  and encodes its input's gradient after it (j > 0), so that gradient leaves e·x later; the all-reduce's
  buckets still follow B_j itself;
- a bucket's all-reduce, s GB a shard, on the all-reduce's threads (``runtime/allreduce.py``): each member
  encodes its D−1 shards (error feedback's encode: encode, decode, residual), handing them over (D−1)·e·s
  after the bucket is ready; the owner decodes the D−1 it receives, (D−1)·d·s after the last arrives; it
  encodes the sum, e·s, before handing it to all (its own copy decoded in that encode), and each member
  decodes the D−1 others', (D−1)·d·s after the last arrives. Every shard waits for all its member's
  encodes and all its receiver's decodes: exact with D = 2, an upper bound beyond;
- DiLoCo's pseudo-gradients go through the same all-reduce once a round (1/H of it a step, as its bytes).

The closed form adds a stage's codec time to C_j, and an exchange's (the largest stage's, all its
buckets) to every group value, half on each of a member's two terms. For fp32 both are 0: a message's
local cost, tensor to bytes and back, is ``message_s``'s already.

A device starts step t+1 ``boundary_s`` after it ended step t (what the agent does between steps: its
heartbeat, reading the run's records). Step t's time is when its last device ended it minus when the last
device ended step t−1 (the swarm's measured step time, which is the period in steady state).

Links, as the emulator shapes them: the directed link a→b is a FIFO. A message of x GB handed to it at
time t starts at max(t, when the link is free), occupies it 8x/β_ab (bandwidth serialises) and arrives
α_ab + o later, o being the transport's own per-message overhead (latency overlaps with the next
message's serialisation). Different destinations are different FIFOs: a device's D−1 shard messages
travel in parallel — unlike the paper's model, which sums them.

Access links (``Cluster.uplink_gbps``/``downlink_gbps``; a home's router, one queue per direction for all
its flows): device p may have an uplink U_p and a downlink D_p besides each pair's α_ab and β_ab. A message
of n = 8x Gbit that a hands to b at t (the emulator's model, ``net/transport/emulation.py``):

1. sender: s = max(t, pair_free[a→b], up_free[a]); pair_free[a→b] = s + n/min(β_ab, U_a);
   up_free[a] = s + n/U_a. Its bytes reach b from s + α_ab + o on, the last at e = s + n/min(β_ab, U_a) + α_ab + o;
2. receiver: d = max(s + α_ab + o, down_free[b]); down_free[b] = d + n/D_b; delivered at f = max(d + n/D_b, e).

A device without U (D) has no such queue (not a queue of infinite rate: nothing waits in it), so with
neither this is exactly the per-link model above, and the same code runs as before. Every message goes
through it: activations and their gradients, the all-reduce's shards both ways (the clip's scalars below).
Each queue serves its messages in the order the simulation hands them over, which is their time order
except where noted: within a step, the pipeline's messages in the step's order (``step_order``: each
device's own sends in its own order, so its uplink is exact), then each stage's all-reduce as soon as the
stage's last backward pass is done, its shards and that pass's gradient to the stage before (handed over
before the stage's buckets, which wait for it, so first on the uplink) in hand-over order on every uplink and arrival order on every downlink (a fixed point, as without access links). A downlink
serves the messages of a step's pipeline before the all-reduce's, and a step's before the next step's:
where a faster pipeline's shard reaches a device still receiving its own pipeline's gradients, or a
neighbour's next activations reach a device still in its all-reduce, the real queue would interleave them
(1F1B can interleave a stage's incoming activations and gradients too). Tests check the simulation
against a brute-force event simulation in time order (``tests/planning/access_sim.py``): equal where these
cannot occur; on home-like networks with 1F1B most periods are equal too, and the others within about 10 %.

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
- Access links, in the closed form: a hop's link a→b moves its micro-batch at the slowest of the pair,
  a's uplink and b's downlink (a message alone in those queues), 8x·max(1/β_ab, 1/U_a, 1/D_b); contention
  between the pipeline's messages and the all-reduce's is left to the simulation. In the all-reduce each
  member sends D−1 shards through its uplink and receives D−1 through its downlink in each phase, so the
  pair value adds 8s(D−2)·(1/U_a + 1/D_b): a shard queued behind its phase's other shards at both ends
  (an estimate on the high side: in a balanced exchange the shards queue mostly at one end; the search
  uses it to compare groups, the plan is then simulated exactly). Without access links these are the
  terms above.
- The recompute check, in the closed form: C_j is F_j · (1 + ρ) + B_j · (1 + ρ) (its codecs' part as
  before), and every pair's all-reduce value adds the largest stage's reveal (⌈ρ·M⌉ micro-batches of 2 messages,
  4 at a middle stage) sent alone on it, 8r·max(1/β_ab, 1/U_a, 1/D_b): a member's term so adds the reveal it
  sends and the one it receives, charged after the pipeline, in front of the all-reduce. An upper bound (on
  access links an estimate on the high side, as above): in the simulation the reveal leaves at the step's
  start, delaying the first sends on its uplink by at most that much, and the all-reduce only where still in
  flight on the pair. With ``sync_overlap`` the step is the longer of the pipeline part and the slowest group's
  value over H (the round's all-reduce spread over its steps).

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

    The codecs' CPU time (``encode_s_per_gb``, ``decode_s_per_gb``; module docstring, "Codecs"): seconds to
    encode and to decode one GB of each kind's volume as the workload counts it (before the wire), for
    activations, their gradients and data-parallel gradients (whose encode is error feedback's: encode,
    decode and residual); 0 for fp32, whose cost is ``message_s``'s.

    ``verify_gb``: the sum check's two messages (a commit, then a sketch statement), GB each, that every member
    of a group sends every other member after the step's all-reduce (``runtime.calibration.verify_volumes``);
    (0, 0) where no check runs. ``recompute_rate``: the recompute check's (``verify.recompute_check``, ``[verify]
    rate``) expected challenged micro-batches per member and step over M, in [0, 1]: each member reveals their
    pipeline messages to its verifier at the next step's start and recomputes as many of another member's
    during it (module docstring, steps 1–2); 0 where no check runs. Priced only on plans the runtime installs
    the check on: two or more stages and replicas, every-step sync.
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
    sync_overlap: bool = False  # DiLoCo: the round's all-reduce streams during the next round (module docstring)
    overlap_steps: int = 0  # ... during its first this many steps (``DiLoCoConfig.overlap_steps``; 0: all H)
    fragments: int = 1  # ... in this many fragments, staggered (``DiLoCoConfig.fragments``; module docstring)
    encode_s_per_gb: tuple[float, float, float] = (0.0, 0.0, 0.0)  # activations, their gradients, DP gradients
    decode_s_per_gb: tuple[float, float, float] = (0.0, 0.0, 0.0)
    verify_gb: tuple[float, float] = (0.0, 0.0)  # the sum check's commit and sketch messages (step 3); 0: none
    recompute_rate: float = 0.0  # the recompute check's challenged micro-batches per member, over M (steps 1–2)

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
        for name in ("encode_s_per_gb", "decode_s_per_gb"):
            costs = tuple(getattr(self, name))
            if len(costs) != 3 or not all(_is_seconds(v) for v in costs):
                raise ValueError(f"step profile: {name} must be three non-negative numbers, got {costs!r}")
            object.__setattr__(self, name, tuple(float(v) for v in costs))
        volumes = tuple(self.verify_gb)
        if len(volumes) != 2 or not all(_is_seconds(v) for v in volumes):
            raise ValueError(f"step profile: verify_gb must be two non-negative numbers, got {volumes!r}")
        object.__setattr__(self, "verify_gb", tuple(float(v) for v in volumes))
        if not (_is_seconds(self.recompute_rate) and self.recompute_rate <= 1):
            raise ValueError(f"step profile: recompute_rate must be a number in [0, 1], got {self.recompute_rate!r}")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"step profile: sync_every must be a positive integer, got {self.sync_every!r}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"step profile: fragments must be a positive integer, got {self.fragments!r}")
        if self.sync_overlap and self.sync_every == 1:
            raise ValueError("step profile: sync_overlap streams a DiLoCo round's all-reduce and needs sync_every > 1")
        if not (math.isfinite(self.bucket_gb) and self.bucket_gb >= 0):
            raise ValueError(f"step profile: bucket_gb must be a non-negative number, got {self.bucket_gb!r}")

    @property
    def streamed_steps(self) -> int:
        """The steps a streamed round's all-reduce is spread over (``sync_overlap``): τ per fragment, τ · F in
        all, at most H."""
        return min((self.overlap_steps or self.sync_every) * self.fragments, self.sync_every)

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
            encode_s_per_gb=tuple(v * factor for v in self.encode_s_per_gb),
            decode_s_per_gb=tuple(v * factor for v in self.decode_s_per_gb),
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
    sync_extra_s: float = 0.0  # ... and takes this much longer (streamed: the round is this much longer)

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
        # access links: seconds per GB through each device's uplink and downlink (0 where it has none), and
        # a message's seconds per GB on its path, the pair's or the sender's uplink, whichever is slower
        self.access = cluster.has_access_links
        self.has_up, self.up_s_per_gb = _access(cluster.uplink_gbps, n)
        self.has_down, self.down_s_per_gb = _access(cluster.downlink_gbps, n)
        self.send_s_per_gb = self.s_per_gb
        if self.access:
            self.send_s_per_gb = np.maximum(self.s_per_gb, self.up_s_per_gb[:, None] * off)
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
        # the codecs' CPU time (module docstring, "Codecs"): a stage's per micro-batch, on its compute thread ...
        enc_act, enc_grad, enc_dp = profile.encode_s_per_gb
        dec_act, dec_grad, dec_dp = profile.decode_s_per_gb
        volume_gb = workload.activation_gb / m  # one micro-batch's activations (or gradients) before the wire
        inner = np.arange(s) > 0, np.arange(s) < s - 1  # stages that receive activations, that send them
        self.codec_forward_s = volume_gb * (dec_act * inner[0] + enc_act * inner[1])
        self.codec_before_backward_s = volume_gb * dec_grad * inner[1]  # the gradient received, decoded
        self.codec_after_backward_s = volume_gb * enc_grad * inner[0]  # the input's gradient, encoded
        # ... and each all-reduce bucket's, per member: [stage, bucket]
        bucket_shard_gb = workload_gradient_gb[:, None] * shares / d
        self.rs_encode_s = (d - 1) * enc_dp * bucket_shard_gb  # its shards, before they are handed over
        self.rs_decode_s = (d - 1) * dec_dp * bucket_shard_gb  # the owner's, of the shards it sums
        self.ag_encode_s = (d > 1) * enc_dp * bucket_shard_gb  # the owner's, of the sum
        self.ag_decode_s = (d - 1) * dec_dp * bucket_shard_gb  # every member's, of the others' sums
        # the recompute check (steps 1–2) where the runtime installs it: a device computes 1 + ρ times its stage's
        # forwards and backwards; a member reveals ρ·M micro-batches' messages, 2 or (middle stages) 4 of each
        rho = profile.recompute_rate if d > 1 and s > 1 and profile.sync_every == 1 else 0.0
        self.recompute_factor = 1.0 + rho
        neighbours = inner[0].astype(float) + inner[1]
        # in the simulated steps each member reveals its ⌈ρ·M⌉ micro-batches a step: a step waits for its slowest
        # pipeline, and with a few members one of them is challenged most steps (8 at ρ·M = 1/4: 90 % of steps),
        # its reveal on its uplink ahead of its pipeline's messages; the mean ρ·M would price that step too short
        self.reveal_gb = math.ceil(rho * m - 1e-9) * neighbours * (self.activation_gb + self.activation_grad_gb)  # [stage]
        self.forward_s = profile.per_stage("forward_s", s, 0.0)
        self.backward_s = profile.per_stage("backward_s", s, 0.0)
        self.update_s = profile.per_stage("update_s", s, 0.0)
        self.slowdown = _slowdown(cluster, profile.reference_tflops)
        alone = np.maximum(self.send_s_per_gb, self.down_s_per_gb[None, :] * off) if self.access else self.s_per_gb
        forward = self.delay_s + self.activation_gb * alone
        backward = self.delay_s + self.activation_grad_gb * alone
        hop = forward + backward.T
        hop = (hop + hop.T) / 2  # symmetric (it is already when links are; only formats differ by direction)
        np.fill_diagonal(hop, 0.0)
        hop.setflags(write=False)
        self.hop_link_s = hop
        shard_gb = self.gradient_gb.max() / d
        pair_dp = self.delay_s + shard_gb * alone
        if self.access and d > 2:  # each shard behind its phase's D − 2 others at both ends
            pair_dp = pair_dp + shard_gb * (d - 2) * (self.up_s_per_gb[:, None] + self.down_s_per_gb[None, :])
        # the codecs' time of the largest stage's exchange (its buckets' in a row), half on each of a member's terms
        codec_dp = float((self.rs_encode_s + self.rs_decode_s + self.ag_encode_s + self.ag_decode_s).sum(axis=1).max())
        if rho > 0:  # the largest stage's reveal, alone on the pair (module docstring: the closed form's bound)
            pair_dp = pair_dp + float(self.reveal_gb.max()) * alone
        self._pair_dp_s = np.where(off, pair_dp + codec_dp / 2, 0.0)
        worst = float(self.slowdown.max())
        self._compute_s = ((self.forward_s + self.backward_s) * worst * self.recompute_factor + self.codec_forward_s
                           + self.codec_before_backward_s + self.codec_after_backward_s)
        self._update_s = self.update_s * worst
        self._clip_s = float(self.delay_s.max()) if profile.clip and s > 1 else 0.0
        # the sum check's rounds (every step only): each a message from every other member, behind each other
        self._verify_s = sum(float((self.delay_s + gb * (d - 1) * alone).max()) for gb in profile.verify_gb
                             if gb > 0 and d > 1)  # fmt: skip
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
        if self.profile.sync_overlap:  # streamed: the round's all-reduce runs beside the next round's steps
            local = pipeline + float(self._update_s.max()) + self.profile.boundary_s + self._clip_s
            step = max(local, max(float(g) for g in group_values) / self.profile.streamed_steps)
            return CostBreakdown(cost_s=step, data_parallel_s=step - pipeline, pipeline_s=pipeline)
        data_parallel = max(float(g) / h + float(u) for g, u in zip(group_values, self._update_s, strict=True))
        data_parallel += self.profile.boundary_s + self._clip_s + self._verify_s
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
        h = self.profile.sync_every
        if h == 1 or self.num_replicas == 1:
            return _simulate(self, sigma, steps or self.profile.steps)
        local = _simulate(self, sigma, steps or self.profile.steps, all_reduce=False)
        if self.profile.sync_overlap:
            # the τ steps that carry the round's all-reduce are this much longer, so is the round
            extra = self.profile.streamed_steps * max(0.0, self.streamed_floor_s(sigma) - local.predicted_s)
        else:  # the round's end: its all-reduce after the clip and the update
            synced = _simulate(self, sigma, steps or self.profile.steps, round_end=True)
            extra = max(0.0, synced.predicted_s - local.predicted_s)
        return dataclasses.replace(local, data_parallel_s=local.data_parallel_s + extra / h, sync_every=h,
                                   sync_extra_s=extra)

    def streamed_floor_s(self, assignment: np.ndarray) -> float:
        """The busiest queue's seconds per step with a DiLoCo round's all-reduce streamed over its H steps
        (``sync_overlap``, module docstring): each queue's share of one step's bytes, pipeline and 1/H of the
        round's shards (2·(D−1) shards of g_j/D out of and into every member of stage j's group)."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        d, m, n = self.num_replicas, self.micro_batches, len(self.hop_link_s)
        pair_gb = np.zeros((n, n))  # GB a step sends a→b
        a, b = sigma[:, :-1], sigma[:, 1:]
        pair_gb[a, b] += m * self.activation_gb
        pair_gb[b, a] += m * self.activation_grad_gb
        if d > 1:
            cols = sigma.T  # [j, i]
            shards = (2 * self.gradient_gb / d / self.profile.streamed_steps)[:, None, None]
            pair_gb[cols[:, :, None], cols[:, None, :]] += np.where(np.eye(d, dtype=bool)[None], 0.0, shards)
        busiest = float((pair_gb * self.send_s_per_gb).max())
        if self.access:
            busiest = max(busiest, float((pair_gb.sum(axis=1) * self.up_s_per_gb).max()),
                          float((pair_gb.sum(axis=0) * self.down_s_per_gb).max()))
        return busiest

    def compute_s(self, assignment: np.ndarray) -> float:
        """The busiest device's compute per step: M forwards and backwards of its stage and its update, at its
        speed (a plan's compute utilisation is this over its step time; the recompute check's is left out: it
        trains nothing)."""
        sigma = check_assignment(assignment, self.num_replicas, self.num_stages, len(self.hop_link_s))
        per_stage = self.micro_batches * (self.forward_s + self.backward_s) + self.update_s
        return float((per_stage[None, :] * self.slowdown[sigma]).max())


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


def _is_seconds(value: object) -> bool:
    """A non-negative finite number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value >= 0


def _swapped(order: tuple[int, ...], a: int, b: int) -> tuple[int, ...]:
    out = list(order)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _access(capacity_gbps: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Which devices have this access link, and its seconds per GB (0 where they have none)."""
    if capacity_gbps is None:
        return np.zeros(n, dtype=bool), np.zeros(n)
    has = np.isfinite(capacity_gbps)
    return has, np.where(has, GBIT_PER_GB / capacity_gbps, 0.0)


def _slowdown(cluster: Cluster, reference_tflops: float | None) -> np.ndarray:
    """Per device: how many times longer than the reference device it computes (1 when unknown)."""
    if reference_tflops is None:
        return np.ones(cluster.num_devices)
    return np.array([reference_tflops / d.tflops if d.tflops else 1.0 for d in cluster.devices])


def _simulate(obj: SimulatedObjective, sigma: np.ndarray, steps: int, all_reduce: bool = True,
              round_end: bool = False) -> SimulatedSteps:
    """``steps`` steps of ``sigma``; ``all_reduce``: with the groups' all-reduce, during and after the last
    backward pass as every-step sync runs it, or with ``round_end`` as a DiLoCo round's end runs it
    (``executor.StageExecutor._outer_step``): after the clip's exchange and the update, every bucket at once."""
    d, s, m = obj.num_replicas, obj.num_stages, obj.micro_batches
    a, b = sigma[:, :-1], sigma[:, 1:]  # pipeline i's hop h: a[i, h] → b[i, h]
    lat_f, ser_f = obj.delay_s[a, b], obj.activation_gb * obj.send_s_per_gb[a, b]
    lat_b, ser_b = obj.delay_s[b, a], obj.activation_grad_gb * obj.send_s_per_gb[b, a]
    cols = sigma.T  # cols[j, i]: stage j's member of pipeline i
    src, dst = cols[:, :, None], cols[:, None, :]
    lat_g = obj.delay_s[src, dst]  # [j, i, k]: link from member i to member k of stage j's group
    shard_gb = obj.gradient_gb[:, None] * obj.bucket_share / d  # [j, k]: one bucket's shard
    ser_g = shard_gb[:, None, None, :] * obj.s_per_gb[src, dst][..., None]  # [j, i, r, k]
    slow = obj.slowdown[sigma]
    grow = slow * obj.recompute_factor  # the recompute check's share of each pass (steps 1–2)
    fwd, bwd, upd = obj.forward_s * grow + obj.codec_forward_s, obj.backward_s * grow, obj.update_s * slow
    before_bwd, after_bwd = obj.codec_before_backward_s, obj.codec_after_backward_s  # [s]: decode, encode
    last_backward = {j: max(k for k, (kind, jj, _) in enumerate(obj.order) if kind == BACKWARD and jj == j)
                     for j in range(s)}
    free_f = np.full((d, s - 1), -np.inf)  # when each link is free again (FIFO), kept across steps
    free_b = np.full((d, s - 1), -np.inf)
    free_g = np.full((s, d, d), -np.inf)
    access = _Access(obj, sigma, free_f, free_b, free_g) if obj.access else None
    in_step = d > 1 and all_reduce and not round_end  # every-step sync: the all-reduce in the step
    shared_all_reduce = access is not None and in_step  # each stage's, once its last backward is done
    start = np.zeros((d, s))
    step_s: list[float] = []
    completed = pipeline_s = 0.0
    for _ in range(steps):
        if in_step and obj.reveal_gb.any():  # the recompute check's reveals, ahead of the step's sends
            free_g = _reveal(obj, sigma, start, free_g, access)
        busy = start.copy()  # when each device is done with what it computed so far
        sent = start.copy()  # when each device's last pipeline message arrived
        arrive_f = np.zeros((d, s, m))  # when micro-batch mb's activations reach stage j
        arrive_b = np.zeros((d, s, m))  # ... and its gradient
        last_start = start.copy()  # when each device began its last backward pass
        all_reduced = np.empty((s, d))
        for k, (kind, j, mb) in enumerate(obj.order):  # each stage's own order (``wire_model.step_order``)
            if kind != BACKWARD:
                busy[:, j] = (busy[:, j] if j == 0 else np.maximum(busy[:, j], arrive_f[:, j, mb])) + fwd[:, j]
                if j < s - 1:
                    if access is not None:
                        arrive_f[:, j + 1, mb] = access.send(free_f, j, j, j + 1, obj.activation_gb, busy[:, j])
                    else:
                        free_f[:, j] = np.maximum(busy[:, j], free_f[:, j]) + ser_f[:, j]
                        arrive_f[:, j + 1, mb] = free_f[:, j] + lat_f[:, j]
                    sent[:, j] = np.maximum(sent[:, j], arrive_f[:, j + 1, mb])
                continue
            ready = (busy[:, j] if j == s - 1 else np.maximum(busy[:, j], arrive_b[:, j, mb])) + before_bwd[j]
            if k == last_backward[j]:
                last_start[:, j] = ready
            busy[:, j] = ready + bwd[:, j] + after_bwd[j]
            if shared_all_reduce and k == last_backward[j]:
                all_reduced[j], tail = access.all_reduce(j, last_start[:, j], bwd[:, j], busy[:, j])
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
        backward_done = busy.T  # [j, i]
        if not shared_all_reduce:
            all_reduced = backward_done
        if in_step and access is None:
            all_reduced, free_g = _all_reduce(obj, last_start.T, bwd.T, backward_done, free_g, ser_g, lat_g)
        reduced = all_reduced.T  # [i, j]
        if in_step:  # the sum check's two rounds (step 3), each waiting for the other members'
            for gb in obj.profile.verify_gb:
                reduced = _group_exchange(obj, sigma, reduced, gb, access)
        if obj.profile.clip and s > 1:  # every other stage's norm (the diagonal's delay is 0: its own)
            delay = obj.delay_s[sigma[:, :, None], sigma[:, None, :]]
            if access is None:
                reduced = (reduced[:, :, None] + delay).max(axis=1)
            else:  # a norm leaves once its sender's uplink is free
                others = np.where(np.eye(s, dtype=bool), -np.inf, delay)
                reduced = np.maximum(reduced, (np.maximum(reduced, access.up_free)[:, :, None] + others).max(axis=1))
        end = np.maximum(reduced + upd, sent)
        if d > 1 and all_reduce and round_end:  # DiLoCo: the pseudo-gradients once the update is done
            updated = reduced + upd
            if access is None:
                done, free_g = _all_reduce(obj, last_start.T, bwd.T, updated.T, free_g, ser_g, lat_g, overlap=False)
            else:
                done = np.stack([access.all_reduce(j, last_start[:, j], bwd[:, j], updated[:, j], round_end=True)[0]
                                 for j in range(s)])
            end = np.maximum(done.T, sent)
        crit = np.unravel_index(int(np.argmax(end)), end.shape)  # the device that ends the step last
        pipeline_s = float(busy[crit] - start[crit])
        step_s.append(float(end[crit]) - completed)
        completed = float(end[crit])
        start = end + obj.profile.boundary_s
    predicted = step_period(step_s[1:])  # ``SimulatedSteps.predicted_s``
    return SimulatedSteps(step_s=tuple(step_s), pipeline_s=pipeline_s, data_parallel_s=predicted - pipeline_s)


def _reveal(obj: SimulatedObjective, sigma: np.ndarray, start: np.ndarray, free_g: np.ndarray,
            access: _Access | None) -> np.ndarray:
    """The recompute check's reveals at the step's ``start`` ([pipeline, stage]): member i of every group sends
    its ``reveal_gb`` to its verifier, member i + 1 mod D (the runtime rotates by 1 + σ, σ drawn each step:
    priced as σ = 0, the only rotation with two replicas). Without access links it takes the pair's FIFO
    (``free_g`` [stage, src, dst]) and delays the all-reduce only if still on it when the shards go; with them
    ``_Access.reveal`` queues it on the sender's uplink and the receiver's downlink too. Nothing waits for its
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
                    access: _Access | None) -> np.ndarray:
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


def _fifo(hand_over: np.ndarray, service_s: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A FIFO queue serving messages in the order of the last axis: message q starts at max(its hand-over,
    when message q − 1 is through) and is through ``service_s`` later; ``free`` is when the queue is free
    before the first. Returns each message's start and the queue's free time after it. The recurrence
    t_q = max(h_q, t_{q−1}) + u_q, unrolled: t_q = C_q + max(free, max_{p≤q}(h_p − C_{p−1})), C the running
    sum of u (max-plus, so it vectorises). A padding message (hand-over −inf, service 0) changes nothing."""
    through = np.cumsum(service_s, axis=-1)
    before = np.concatenate([np.zeros_like(through[..., :1]), through[..., :-1]], axis=-1)
    after = through + np.maximum(free[..., None], np.maximum.accumulate(hand_over - before, axis=-1))
    return np.maximum(hand_over, np.concatenate([free[..., None], after[..., :-1]], axis=-1)), after


def _unsort(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    np.put_along_axis(out, order, values, axis=-1)
    return out


class _Access:
    """The queues of a simulation over access links (module docstring): each slot's uplink and downlink
    (``up_free``, ``down_free``: [pipeline, stage], −inf where the device has none), and the pairs' FIFOs,
    shared with ``_simulate`` (its arrays, updated in place)."""

    def __init__(self, obj: SimulatedObjective, sigma: np.ndarray, free_f: np.ndarray, free_b: np.ndarray,
                 free_g: np.ndarray):
        self.obj, self.sigma, self.free_b, self.free_g = obj, sigma, free_b, free_g
        self.up_free = np.full(sigma.shape, -np.inf)
        self.down_free = np.full(sigma.shape, -np.inf)

    def send(self, free: np.ndarray, col: int, j_from: int, j_to: int, gb: float, hand_over: np.ndarray) -> np.ndarray:
        """One message per pipeline from its stage ``j_from`` to ``j_to`` on the pair FIFO ``free[:, col]``,
        through the sender's uplink and the receiver's downlink; returns when each is delivered."""
        obj, up = self.obj, self.up_free
        a, b = self.sigma[:, j_from], self.sigma[:, j_to]
        start = np.maximum(np.maximum(hand_over, free[:, col]), up[:, j_from])
        free[:, col] = start + gb * obj.send_s_per_gb[a, b]
        up[:, j_from] = np.where(obj.has_up[a], start + gb * obj.up_s_per_gb[a], -np.inf)
        return self._receive(b, j_to, start + obj.delay_s[a, b], free[:, col] + obj.delay_s[a, b], gb)

    def reveal(self, j: int, rows: np.ndarray, verifier: np.ndarray, gb: float, at: np.ndarray) -> None:
        """Member ``rows`` of stage j's group sends ``gb`` to member ``verifier`` (a permutation) at ``at``: on the
        group's pair FIFO, the sender's uplink and the receiver's downlink (``_simulate``'s ``_reveal``)."""
        obj, up, pair = self.obj, self.up_free, self.free_g[j]
        a, b = self.sigma[rows, j], self.sigma[verifier, j]
        start = np.maximum(np.maximum(at, pair[rows, verifier]), up[:, j])
        pair[rows, verifier] = start + gb * obj.send_s_per_gb[a, b]
        up[:, j] = np.where(obj.has_up[a], start + gb * obj.up_s_per_gb[a], -np.inf)
        first, last = np.empty_like(start), np.empty_like(start)  # by receiving row
        first[verifier], last[verifier] = start + obj.delay_s[a, b], pair[rows, verifier] + obj.delay_s[a, b]
        self._receive(self.sigma[:, j], j, first, last, gb)

    def _receive(self, b: np.ndarray, j_to: int, first: np.ndarray, last: np.ndarray, gb: float) -> np.ndarray:
        """A message per pipeline whose bytes reach stage ``j_to`` from ``first`` to ``last``: delivered once
        its downlink let it through too."""
        obj, down = self.obj, self.down_free
        through = np.maximum(first, down[:, j_to]) + gb * obj.down_s_per_gb[b]
        down[:, j_to] = np.where(obj.has_down[b], through, -np.inf)
        return np.maximum(last, down[:, j_to])

    def all_reduce(self, j: int, last_start: np.ndarray, bwd: np.ndarray, backward_done: np.ndarray,
                   round_end: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Stage j's all-reduce ([pipeline] of its members) over the access links, its last backward pass's
        gradient to stage j − 1 queued among the shards on each uplink: when each member has its gradients
        reduced and its shards taken, and when that gradient is delivered (None at stage 0).

        Each member's messages are its gradient (handed over when the pass is done), a reduce-scatter shard
        of each bucket to every other member (when the bucket is ready: after the gradient at stages after 0)
        and an all-gather shard to each (when
        it has every shard of the bucket it owns). Its uplink serves them in hand-over order, each also
        waiting for its pair's FIFO; each downlink in the order their first bytes come. The all-gather's
        hand-over depends on other members' deliveries: iterated from the buckets' readiness to a fixed point
        (``ALL_REDUCE_ROUNDS`` at most, as ``_all_reduce``); a pair slower than its sender's uplink holds the
        uplink's next messages (FIFO), found by iterating the pair FIFOs and the uplink to a fixed point
        (exact after as many rounds as a member sends messages; usually two). ``round_end``: a DiLoCo round's
        all-reduce, every bucket at ``backward_done`` (the update's end), no gradient among them."""
        obj, sigma = self.obj, self.sigma
        d, k_all = obj.num_replicas, obj.buckets
        me = sigma[:, j]
        valid = obj.bucket_share[j] > 0  # [k]
        if obj.overlap and j == 0 and not round_end:  # later stages hold their buckets until the gradient is sent
            ready = last_start[:, None] + obj.bucket_ready[j][None, :] * bwd[:, None]  # [i, k]
        else:
            ready = np.repeat(backward_done[:, None], k_all, axis=1)
        ready = np.where(valid[None, :], ready, -np.inf)
        gb = np.tile(obj.gradient_gb[j] * obj.bucket_share[j] / d, 2)  # [q]: reduce-scatter k, then all-gather k
        sent = np.tile(valid, 2)[None, None, :] & ~np.eye(d, dtype=bool)[:, :, None]  # [i, r, q]: i → r
        lat = obj.delay_s[me[:, None], me[None, :]][:, :, None]
        pair_s = np.where(sent, gb * obj.send_s_per_gb[me[:, None], me[None, :]][:, :, None], 0.0)
        up_s = np.where(sent, gb * obj.up_s_per_gb[me][:, None, None], 0.0)
        down_s = np.where(sent, gb * obj.down_s_per_gb[me][None, :, None], 0.0)  # at the receiver r
        pair_free = self.free_g[j]  # [i, r]
        has_up = obj.has_up[me]
        # the gradient to stage j − 1 leads each member's queue (column 0); a padding message at stage 0 (and at
        # a round's end)
        tail = j > 0 and not round_end
        prev = sigma[:, j - 1] if tail else me
        tail_gb = obj.activation_grad_gb if tail else 0.0
        tail_pair = tail_gb * obj.send_s_per_gb[me, prev]
        tail_at = backward_done if tail else np.full(d, -np.inf)
        tail_eff = np.maximum(tail_at, self.free_b[:, j - 1]) if tail else tail_at  # its pair's FIFO
        binds = bool((has_up[:, None] & (obj.send_s_per_gb[me[:, None], me[None, :]] > obj.up_s_per_gb[me][:, None])
                      & ~np.eye(d, dtype=bool)).any())  # a pair slower than its sender's uplink
        rs_encoded = ready + obj.rs_encode_s[j][None, :]  # the codecs' time (module docstring, "Codecs")
        reduced = ready
        for _ in range(ALL_REDUCE_ROUNDS):
            encoded = reduced + obj.ag_encode_s[j][None, :]
            handed = np.where(sent, np.concatenate([rs_encoded, encoded], axis=1)[:, None, :], -np.inf)  # [i, r, q]
            tail_start, shard_start, up_after = self._senders(handed, tail_at, tail_eff, pair_free, pair_s, up_s,
                                                              tail_gb * obj.up_s_per_gb[me], self.up_free[:, j],
                                                              has_up, binds)
            shard_start = np.where(sent, shard_start, -np.inf)
            arrive, down_after = self._receivers(me, j, shard_start + lat, shard_start + pair_s + lat, down_s)
            arrive = np.where(sent, arrive, -np.inf)
            # [owner, k]: every shard of k is in and decoded
            settled = np.maximum(ready, arrive[..., :k_all].max(axis=0) + obj.rs_decode_s[j][None, :])
            if np.array_equal(settled, reduced):
                break
            reduced = settled
        gathered = np.maximum(reduced + obj.ag_encode_s[j][None, :],
                              arrive[..., k_all:].max(axis=0) + obj.ag_decode_s[j][None, :])  # [i, k]
        sends_taken = arrive.max(axis=(1, 2))
        self.free_g[j] = np.maximum(pair_free, np.where(sent, shard_start + pair_s, -np.inf).max(axis=2))
        self.up_free[:, j] = np.where(has_up, up_after, -np.inf)
        self.down_free[:, j] = down_after
        delivered = None
        if tail:
            self.free_b[:, j - 1] = tail_start + tail_pair
            wire = tail_start + obj.delay_s[me, prev]
            delivered = self._receive(prev, j - 1, wire, wire + tail_pair, tail_gb)
        return np.maximum(backward_done, np.maximum(gathered.max(axis=1), sends_taken)), delivered

    def _senders(self, handed: np.ndarray, tail_at: np.ndarray, tail_eff: np.ndarray, pair_free: np.ndarray,
                 pair_s: np.ndarray, up_s: np.ndarray, tail_up_s: np.ndarray, up_free: np.ndarray,
                 has_up: np.ndarray, binds: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """When each member's gradient ([i]) and shards ([i, r, q]; ``handed`` −inf where none is sent) start,
        and its uplink's free time after them. A member without an uplink: each pair's FIFO alone (in
        hand-over order on the pair). With one: its uplink in hand-over order (at equal times the gradient,
        then bucket by bucket each phase's shards to members 0, 1, …, the runtime's order), a message
        starting no sooner than its pair's FIFO lets it (iterated when a pair is slower than the uplink)."""
        d, is_sent = len(handed), np.isfinite(handed)
        pair_order = np.argsort(handed, axis=2, kind="stable")
        alone, _ = _fifo(np.take_along_axis(handed, pair_order, axis=2),
                         np.take_along_axis(pair_s, pair_order, axis=2), pair_free)
        alone = _unsort(alone, pair_order)
        if not has_up.any():
            return tail_eff, alone, np.full(d, -np.inf)

        def queue(x: np.ndarray, first: np.ndarray) -> np.ndarray:  # [i, r, q] → [i, 1 + q·r], the gradient first
            return np.concatenate([first[:, None], x.transpose(0, 2, 1).reshape(d, -1)], axis=1)

        order = np.argsort(queue(handed, tail_at), axis=1, kind="stable")
        service = np.take_along_axis(queue(up_s, tail_up_s), order, axis=1)
        effective = np.where(is_sent, np.maximum(handed, pair_free[:, :, None]), -np.inf)
        for _ in range(service.shape[1]):  # the n-th message in uplink order is exact after n rounds
            begun, after = _fifo(np.take_along_axis(queue(effective, tail_eff), order, axis=1), service, up_free)
            begun = _unsort(begun, order)
            shared = begun[:, 1:].reshape(d, handed.shape[2], d).transpose(0, 2, 1)
            if not binds:
                break
            ends = np.where(is_sent, shared + pair_s, -np.inf)
            in_pair = np.take_along_axis(ends, pair_order, axis=2)  # the pair's FIFO: free after its earlier ones
            before = np.maximum.accumulate(np.concatenate([pair_free[:, :, None], in_pair[..., :-1]], axis=2), axis=2)
            again = np.where(is_sent, np.maximum(handed, _unsort(before, pair_order)), -np.inf)
            if np.array_equal(again, effective):
                break
            effective = again
        up = has_up[:, None, None]
        return np.where(has_up, begun[:, 0], tail_eff), np.where(up, shared, alone), after[:, -1]

    def _receivers(self, me: np.ndarray, j: int, first: np.ndarray, last: np.ndarray, down_s: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """When each shard ([i, r, q], i → r; −inf where none) is delivered: receiver r's downlink serves them
        in the order their first bytes come; and each downlink's free time after them."""
        obj, d = self.obj, len(me)
        has_down = obj.has_down[me]
        if not has_down.any():
            return last, np.full(d, -np.inf)
        first_r, service_r = first.transpose(1, 0, 2).reshape(d, -1), down_s.transpose(1, 0, 2).reshape(d, -1)
        order = np.argsort(first_r, axis=1, kind="stable")
        begun, after = _fifo(np.take_along_axis(first_r, order, axis=1), np.take_along_axis(service_r, order, axis=1),
                             self.down_free[:, j])
        through = _unsort(begun + np.take_along_axis(service_r, order, axis=1), order)
        through = through.reshape(d, d, -1).transpose(1, 0, 2)  # back to [i, r, q]
        delivered = np.where(has_down[None, :, None], np.maximum(last, through), last)
        return delivered, np.where(has_down, after[:, -1], -np.inf)


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
