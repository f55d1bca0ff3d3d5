"""What a step does besides moving bytes, for the ``simulated`` objective (``docs/simulated.md``): each stage's
compute per micro-batch, the transport's overhead per message, the pause between steps, the codecs' CPU time,
the checks' messages and rate, and the run's settings that change what travels (wire, schedule, buckets,
clipping, DiLoCo's rounds)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.planning.wire_model import SCHEDULES, WIRE_BYTES, wire_factors
from p2ptrain.planning.workload import Workload

DEFAULT_STEPS = 4  # simulated steps; the first is left out of the median, as in measurements


@dataclass(frozen=True)
class StepProfile:
    """What a step does besides moving bytes, in the network's seconds (docs/simulated.md).

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

    The codecs' CPU time (``encode_s_per_gb``, ``decode_s_per_gb``; docs/simulated.md, "Codecs"): seconds to
    encode and to decode one GB of each kind's volume as the workload counts it (before the wire), for
    activations, their gradients and data-parallel gradients (whose encode is error feedback's: encode,
    decode and residual); 0 for fp32, whose cost is ``message_s``'s.

    ``verify_gb``: the sum check's two messages (a commit, then a sketch statement), GB each, that every member
    of a group sends every other member after the step's all-reduce (``runtime.calibration.verify_volumes``);
    (0, 0) where no check runs. ``recompute_rate``: the recompute check's (``verify.recompute_check``, ``[verify]
    rate``) expected challenged micro-batches per member and step over M, in [0, 1]: each member reveals their
    pipeline messages to its verifier at the next step's start and recomputes as many of another member's
    during it (docs/simulated.md, steps 1–2); 0 where no check runs. Priced only on plans the runtime installs
    the check on: two or more stages and replicas, every-step sync. ``verify_compute_s``: the sum check's own
    work per member and step, per stage (its sketches, norms and digests, between its two rounds:
    ``runtime.calibration.check_seconds``); () where no check runs.
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
    sync_overlap: bool = False  # DiLoCo: the round's all-reduce streams during the next round (docs/simulated.md)
    overlap_steps: int = 0  # ... during its first this many steps (``DiLoCoConfig.overlap_steps``; 0: all H)
    fragments: int = 1  # ... in this many fragments, staggered (``DiLoCoConfig.fragments``; docs/simulated.md)
    encode_s_per_gb: tuple[float, float, float] = (0.0, 0.0, 0.0)  # activations, their gradients, DP gradients
    decode_s_per_gb: tuple[float, float, float] = (0.0, 0.0, 0.0)
    verify_gb: tuple[float, float] = (0.0, 0.0)  # the sum check's commit and sketch messages (step 3); 0: none
    recompute_rate: float = 0.0  # the recompute check's challenged micro-batches per member, over M (steps 1–2)
    verify_compute_s: tuple[float, ...] = ()  # the sum check's own work per member and step, per stage (step 3)

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"step profile: micro_batches must be a positive integer, got {self.micro_batches!r}")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"step profile: steps must be an integer of at least 2, got {self.steps!r}")
        for name in ("forward_s", "backward_s", "update_s", "gradient_gb", "verify_compute_s"):
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
            verify_compute_s=tuple(v * factor for v in self.verify_compute_s),
        )


@dataclass(frozen=True)
class StepWorkload(Workload):
    """A workload (c_PP, c_DP) with the step profile the ``simulated`` objective needs."""

    step: StepProfile = field(default_factory=StepProfile)


def _is_seconds(value: object) -> bool:
    """A non-negative finite number (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value >= 0
