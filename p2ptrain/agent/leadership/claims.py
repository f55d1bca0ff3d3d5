"""A device's compute claims, checked: bounded by its calibration, and replaced by what it shows in training.

A peer record says what its device can do: ``tflops`` (a matmul's peak), ``memory_gb``, and for the
simulated objective ``compute`` (its calibration of the run's model, ``runtime.calibration``), which is
what the planner prices its compute with. All are the writer's word; a peer that boasts gets the stages
it cannot carry and slows every step. So:

* **beyond any real device** (``record_problem``): the record's own bounds refuse tflops and memory past
  ``records.MAX_TFLOPS``/``MAX_MEMORY_GB``; a calibration that puts the run's model through faster than
  ``MAX_TFLOPS`` (its block FLOPs over its block time) is refused here. The peer is then no member in any
  agent's view (a pure function of the record, so leader and followers agree).
* **bounded by the calibration** (``bounded``): a device that calibrated cannot claim a matmul peak above
  ``peak_over_calibrated`` times the FLOP/s its own calibration shows (small models reach a few per cent of
  a card's peak; that much is honest); a larger claim is cut to the bound, in every agent's view alike.
* **checked in training** (``ComputeWatch``): every trainer's heartbeat carries its own compute seconds
  in the step (``ProgressRecord.compute_s``: forward, backward, update, none of the waiting). The leader
  compares the median over an epoch with what the peer's calibration predicts for the stage the plan gave
  it (``predicted_compute_s``); where the peer was more than ``speed_tolerance`` times slower (a
  world-wide run is noisy: a shared card, a throttled laptop), its calibration is replaced by the observed
  speed for the next plans, logged with both figures. The plan record names the factors it was made with
  (``PlanRecord.slowdowns``) and followers check its cost with them: only slower, never faster, than the
  records say. A peer that later computes at its claim again gets its claim back.

Memory is not measured in training: a device that claims more than it has fails its epoch (out of
memory) and is quarantined like any failing peer (``churn.quarantine``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from p2ptrain.net.dht.records import (
    MAX_SLOWDOWN,
    MAX_TFLOPS,
    ComputeMeasurement,
    PeerRecord,
    PlanRecord,
    ProgressRecord,
)
from p2ptrain.planning.layers import layer_model
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.split import even_layers
from p2ptrain.runtime.config import TrainConfig


def _block_flops(shape: ModelShape, tokens: float) -> float:
    """Forward and backward FLOPs of one block for ``tokens`` tokens (backward: twice the forward)."""
    return 3 * layer_model(shape, micro_batch_tokens=tokens, micro_batches=1).forward_flops.block


def calibrated_tflops(c: ComputeMeasurement, shape: ModelShape) -> float:
    """The TFLOP/s a calibration shows: one block's FLOPs over its measured forward and backward."""
    return _block_flops(shape, c.rows * c.seq_len) / max(sum(c.layer_s), 1e-12) / 1e12


def record_problem(record: PeerRecord, shape: ModelShape) -> str | None:
    """Why ``record`` claims what no device does (None: plausible). Tflops and memory are bounded by the
    record itself; this checks its calibration of ``shape``."""
    if record.compute is not None and calibrated_tflops(record.compute, shape) > MAX_TFLOPS:
        return (f"its calibration runs the model at {calibrated_tflops(record.compute, shape):.3g} TFLOP/s, beyond "
                f"any device ({MAX_TFLOPS:g})")
    return None


def bounded(record: PeerRecord, shape: ModelShape, peak_over_calibrated: float) -> PeerRecord:
    """``record`` with its tflops cut to ``peak_over_calibrated`` × what its calibration shows."""
    if record.compute is None:
        return record
    bound = peak_over_calibrated * calibrated_tflops(record.compute, shape)
    return dataclasses.replace(record, tflops=bound) if record.tflops > bound else record


def slowed(record: PeerRecord, factor: float) -> PeerRecord:
    """``record`` with a device ``factor`` times slower than it says (calibrated times × factor)."""
    if factor <= 1.0:
        return record
    c = record.compute
    if c is not None:
        c = dataclasses.replace(c, layer_s=tuple(t * factor for t in c.layer_s),
                                embed_s=tuple(t * factor for t in c.embed_s),
                                head_s=tuple(t * factor for t in c.head_s),
                                update_s_per_mparam=c.update_s_per_mparam * factor)
    return dataclasses.replace(record, tflops=record.tflops / factor, compute=c)


def with_slowdowns(peers: Mapping[str, PeerRecord], factors: Mapping[str, float]) -> dict[str, PeerRecord]:
    return {p: slowed(r, factors.get(p, 1.0)) for p, r in peers.items()}


def plan_slowdowns(plan: PlanRecord) -> dict[str, float]:
    """The factors ``plan`` was made with, by peer (``PlanRecord.slowdowns``)."""
    return {plan.membership[i]: factor for i, factor in plan.slowdowns}


def predicted_compute_s(c: ComputeMeasurement, train: TrainConfig, plan: PlanRecord, stage: int) -> float:
    """A step's compute on stage ``stage`` of ``plan`` by the device calibrated as ``c``: every micro-batch's
    forward and backward of the stage's blocks (and the embeddings or the head), then the update."""
    shape, m = train.shape, train.micro_batches
    layers = plan.layer_ranges or even_layers(shape.num_layers, plan.stages)
    blocks = layers[stage][1] - layers[stage][0]
    first, last = stage == 0, stage == plan.stages - 1
    rows = train.global_batch_size // (plan.replicas * m)
    grow = rows * shape.seq_len / (c.rows * c.seq_len)
    per_micro_batch = blocks * sum(c.layer_s) + first * sum(c.embed_s) + last * sum(c.head_s)
    params = layer_model(shape, micro_batch_tokens=1, micro_batches=1).parameters.stage(blocks, first, last)
    return m * per_micro_batch * grow + c.update_s_per_mparam * params / 1e6


@dataclass(frozen=True)
class Slowdown:
    peer: str
    epoch: int
    factor: float  # observed / predicted compute per step
    observed_s: float
    predicted_s: float


class ComputeWatch:
    """The leader's record of each trainer's compute per step, and the factors the next plans use."""

    def __init__(self, tolerance: float, min_steps: int):
        self.tolerance = tolerance
        self.min_steps = min_steps
        self.factors: dict[str, float] = {}  # peer -> how many times slower than its record it computes
        self._seen: dict[tuple[str, int], dict[int, float]] = {}  # (peer, epoch) -> step -> compute_s
        self._judged: set[int] = set()

    def observe(self, plan: PlanRecord, progress: Mapping[str, ProgressRecord]) -> None:
        for peer, r in progress.items():
            if r.epoch == plan.epoch and r.compute_s > 0 and not r.halted and plan.position_of(peer) is not None:
                self._seen.setdefault((peer, plan.epoch), {})[r.step] = r.compute_s

    def judge(self, plan: PlanRecord, peers: Mapping[str, PeerRecord], train: TrainConfig) -> list[Slowdown]:
        """After training ``plan`` (once per epoch): update ``factors`` from what its trainers showed;
        returns the new or changed ones (factor 1: a peer's claim given back)."""
        if plan.epoch in self._judged:
            return []
        self._judged.add(plan.epoch)
        changed = []
        for peer, record in peers.items():
            seen = self._seen.pop((peer, plan.epoch), {})
            position = plan.position_of(peer)
            if record.compute is None or position is None or len(seen) < self.min_steps:
                continue
            predicted = predicted_compute_s(record.compute, train, plan, position[1])
            observed = statistics.median(seen.values())
            factor = min(MAX_SLOWDOWN, observed / predicted) if predicted > 0 else 1.0
            old = self.factors.get(peer, 1.0)
            new = factor if factor > self.tolerance else 1.0
            if new != old:
                if new > 1.0:
                    self.factors[peer] = new
                else:
                    self.factors.pop(peer, None)
                changed.append(Slowdown(peer, plan.epoch, new, observed, predicted))
        self._seen = {k: v for k, v in self._seen.items() if k[1] > plan.epoch}
        return changed

    def slowdowns_of(self, members: Iterable[str]) -> dict[str, float]:
        return {p: self.factors[p] for p in members if p in self.factors}
