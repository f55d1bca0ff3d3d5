"""Calibration: what an agent measures about its own device for the ``simulated`` objective, and how the
leader turns the members' measurements into a step profile.

``calibrate(train, rows, device)`` times, on this device with this process's torch settings, a real forward
and backward of the run's model for one micro-batch of ``rows`` sequences:

- one block alone (``layer_s``); block 0 with the embeddings, and the last block with the final LayerNorm,
  the head and the loss: their excess over one block is what the first (``embed_s``) and the last stage
  (``head_s``) add;
- the update after the all-reduce (flatten the gradients, unflatten the sum, AdamW) of one block, per
  million parameters;
- the local cost of one message: a tensor to bytes and back, its header encoded and decoded, and the two
  thread hand-offs a send and a receive take (the caller's thread to the transport's loop and back). The
  network part of a message (stream, latency) is what the link prober measures, in α;
- what the run's wire codecs (``wire.wire_format(train.wire)``) take to encode and to decode, per million
  float32 elements (``_codec_s_per_melement``): activations and their gradients on a micro-batch's
  activation, data-parallel gradients on one shard of an all-reduce bucket in a group of two
  (``bucket_elements`` / 2), encoded through error feedback as the all-reduce does (encode, decode,
  residual). fp32's is 0: its tensor to bytes and back is the message cost's already;
- what the sum check's own work takes (``_check_s_per_melement``), per million elements of one vector: its
  sketch with its norm, on this device, and the digest of its message in the run's gradient codec.

Each timing is the fastest of ``repeats`` runs after a warm-up, a few milliseconds apart: the least
disturbed sample, as the link prober takes the fastest transfer. That is the device's speed, not the
load of the moment: agents calibrate while they start up, and on a machine shared by a whole local swarm
that is the busiest moment of the run (every agent starting its DHT and libp2p daemons at once), which
would inflate a median several times over. What a step loses to other processes on a shared machine
while it trains is therefore not in the profile (the e2e benchmark measures how much it is).

``step_workload`` (leader): a stage's compute is its blocks' plus the first/last excess, scaled linearly
from the calibrated rows to the plan's micro-batch; the median over the members' measurements (robust to
one noisy agent); the exact parameter count of each stage for its gradient volume; everything converted to
the emulated network's units (seconds / time_scale, bytes / size_factor).

``layered_workload`` (leader, mixed devices): not the median but each device's own measurement — the
workload priced per layer at the fastest device's speed, every device's measured speed in its cluster
entry (``with_measured_speeds``), so that the planner chooses the layer split and the assignment together
(``planning.joint``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch

from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.stage import build_stage, stage_layer_range
from p2ptrain.net.dht.records import ComputeMeasurement
from p2ptrain.net.transport.messages import (
    Header,
    MessageKind,
    Tag,
    dtype_name,
    tensor_bytes,
    tensor_from_bytes,
)
from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.layers import LayerCosts, LayeredWorkload, Parts, layer_model
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.simulated import StepProfile, StepWorkload
from p2ptrain.planning.workload import GB, Workload
from p2ptrain.runtime.allreduce import flatten, unflatten_into
from p2ptrain.runtime.buckets import plan_buckets
from p2ptrain.runtime.compute_speed import NO_PACING, ComputePacer
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import Codec, ErrorFeedback, wire_format
from p2ptrain.verify import statement
from p2ptrain.verify.attest import commit_bytes, sketch_bytes
from p2ptrain.verify.commit import message_digest
from p2ptrain.verify.config import VerifyConfig, runs_sums
from p2ptrain.verify.sketch import SKETCH_ROWS, sketches_and_norms

logger = logging.getLogger(__name__)

DEFAULT_REPEATS = 9
SPACING_S = 0.005
FP32_BYTES = 4


def calibrate(train: TrainConfig, rows: int, device: torch.device, repeats: int = DEFAULT_REPEATS,
              compute_slowdown: float = 1.0) -> ComputeMeasurement:
    """Time the run's model on ``device`` for micro-batches of ``rows`` sequences (module docstring);
    ``compute_slowdown`` > 1 paces the compute as the trainer will (an emulated slower device)."""
    shape = train.shape
    pacer = ComputePacer(compute_slowdown, cpu_clock=torch.device(device).type == "cpu")
    started = time.perf_counter()
    num_layers = shape.num_layers
    first = _time_block(train, 0, rows, device, repeats, pacer)
    if num_layers >= 3:  # block 1 is a plain block; the ends' excess over it is what the ends add
        plain = _time_block(train, 1, rows, device, repeats, pacer)
        final = _time_block(train, num_layers - 1, rows, device, repeats, pacer)
        layer = (plain.forward_s, plain.backward_s)
    else:  # no plain block: the ends are all there is (one block: stage 0 holds everything)
        plain = first
        final = _time_block(train, 1, rows, device, repeats, pacer) if num_layers == 2 else _Timing(0.0, 0.0, 0.0, 1)
        layer = (0.0, 0.0)
    measurement = ComputeMeasurement(
        rows=rows, seq_len=shape.seq_len, layer_s=layer,
        embed_s=(max(first.forward_s - layer[0], 0.0), max(first.backward_s - layer[1], 0.0)),
        head_s=(max(final.forward_s - layer[0], 0.0), max(final.backward_s - layer[1], 0.0)),
        update_s_per_mparam=plain.update_s / plain.parameters * 1e6,
        message_s=_message_s(rows, shape, repeats),
        codec_s_per_melement=_codec_s_per_melement(train, rows, repeats),
        check_s_per_melement=_check_s_per_melement(train, device, repeats),
    )
    logger.info("calibrated %s at %d rows in %.2f s: block %.2f/%.2f ms, embeddings +%.2f/%.2f ms, head "
                "+%.2f/%.2f ms, update %.2f ms per Mparam, %.2f ms per message, %s codecs %s ms per M elements "
                "(encode/decode)", train.model, rows,
                time.perf_counter() - started, *(1e3 * v for v in measurement.layer_s),
                *(1e3 * v for v in measurement.embed_s), *(1e3 * v for v in measurement.head_s),
                1e3 * measurement.update_s_per_mparam, 1e3 * measurement.message_s, train.wire,
                ", ".join(f"{1e3 * e:.2f}/{1e3 * d:.2f}" for e, d in measurement.codec_s_per_melement))
    return measurement


class _Timing:
    def __init__(self, forward_s: float, backward_s: float, update_s: float, parameters: int):
        self.forward_s, self.backward_s, self.update_s, self.parameters = forward_s, backward_s, update_s, parameters


def _time_block(train: TrainConfig, block: int, rows: int, device: torch.device, repeats: int,
                pacer: ComputePacer = NO_PACING) -> _Timing:
    """Forward, backward and update of block ``block`` alone, with the embeddings or head if it has them."""
    shape = train.shape
    module = build_stage(shape, block, shape.num_layers, train.seed, device)  # one block a stage
    optimizer = build_optimizer(module, train.optimizer)
    params = [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(train.seed)
    tokens = torch.randint(0, shape.vocab_size, (rows, shape.seq_len), generator=generator).to(device)
    hidden = torch.randn(rows, shape.seq_len, shape.boundary_width, generator=generator).to(device)
    forward, backward, update = [], [], []
    for _ in range(repeats + 1):  # the first round warms up (allocations, kernels)
        x = tokens if module.has_embeddings else hidden.clone().requires_grad_(True)
        start = _now(device)
        with pacer.compute():
            out = module(x, tokens)
            if module.has_head:
                out = micro_batch_loss(out, tokens, train.global_batch_size * shape.seq_len)
            _now(device)
        mid = _now(device)
        with pacer.compute():
            out.backward() if module.has_head else out.backward(hidden)
            _now(device)
        end = _now(device)
        with pacer.compute():
            flat = flatten([p.grad for p in params])
            unflatten_into(flat, [p.grad for p in params])
            optimizer.step()
            _now(device)
        optimizer.zero_grad(set_to_none=False)
        forward.append(mid - start)
        backward.append(end - mid)
        update.append(_now(device) - end)
        time.sleep(SPACING_S)  # samples apart in time: a preemption spoils one, not all
    return _Timing(min(forward[1:]), min(backward[1:]), min(update[1:]), sum(p.numel() for p in params))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _message_s(rows: int, shape: ModelShape, repeats: int) -> float:
    """The local cost of one activation message: bytes and header both ways, and two thread hand-offs."""
    tensor = torch.randn(rows, shape.seq_len, shape.boundary_width)
    tag = Tag("calibration", 0, 0, MessageKind.ACTIVATION)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="p2ptrain-calibration", daemon=True)
    thread.start()

    async def hand_back(payload: bytes) -> bytes:
        return payload

    def one() -> None:
        header = Header(tag, dtype_name(tensor.dtype), tuple(tensor.shape))
        payload = tensor_bytes(tensor)
        payload = asyncio.run_coroutine_threadsafe(hand_back(payload), loop).result(timeout=10)
        decoded = Header.decode(header.encode())
        received = tensor_from_bytes(bytearray(payload), decoded.dtype, decoded.shape)
        asyncio.run_coroutine_threadsafe(hand_back(b""), loop).result(timeout=10)
        assert received.shape == tensor.shape

    try:
        return _fastest_s(one, repeats)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _codec_s_per_melement(train: TrainConfig, rows: int, repeats: int) -> tuple[tuple[float, float], ...]:
    """(encode, decode) seconds per million elements of the run's codec of each kind (module docstring)."""
    shape, wire = train.shape, wire_format(train.wire)
    activation = (rows, shape.seq_len, shape.boundary_width)
    shard = (max(1, train.bucket_elements // 2),)
    generator = torch.Generator().manual_seed(train.seed)
    kinds = ((wire.activation, activation, None), (wire.activation_grad, activation, None),
             (wire.gradient, shard, ErrorFeedback(wire.gradient)))
    return tuple((0.0, 0.0) if codec.exact else _codec_s(codec, torch.randn(size, generator=generator), feedback,
                                                           repeats)
                 for codec, size, feedback in kinds)


def _check_s_per_melement(train: TrainConfig, device: torch.device, repeats: int) -> tuple[float, float]:
    """(sketch, digest) seconds per million elements of the sum check's work (``verify.sum_check``) on one shard
    of an all-reduce bucket in a group of two: its sketch (``SKETCH_ROWS`` rows) with its norm on ``device``, and
    the digest of its message in the run's gradient codec."""
    shard = max(1, train.bucket_elements // 2)
    vector = torch.randn(shard, generator=torch.Generator().manual_seed(train.seed)).to(device)
    message = wire_format(train.wire).gradient.encode(vector).cpu()
    per_melement = 1e6 / shard
    return (_fastest_s(lambda: sketches_and_norms([vector], 1, SKETCH_ROWS, device=device), repeats) * per_melement,
            _fastest_s(lambda: message_digest(message, "calibration"), repeats) * per_melement)


def _codec_s(codec: Codec, tensor: torch.Tensor, feedback: ErrorFeedback | None, repeats: int
             ) -> tuple[float, float]:
    """(encode, decode) seconds per million elements of ``codec`` on ``tensor``; encoded through ``feedback``
    (the residual added, the message decoded, the residual kept) when given."""
    shape, message = tuple(tensor.shape), codec.encode(tensor)

    def encode() -> None:
        if feedback is None:
            codec.encode(tensor)
        else:
            feedback.encode("calibration", tensor)

    per_melement = 1e6 / tensor.numel()
    return (_fastest_s(encode, repeats) * per_melement,
            _fastest_s(lambda: codec.decode(message, shape), repeats) * per_melement)


def _fastest_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        time.sleep(SPACING_S)
    return min(times)


# -- the leader's side ----------------------------------------------------------------------------------------


def stage_parameters(shape: ModelShape, num_stages: int) -> list[int]:
    """Parameters of each stage (built on the meta device: nothing is allocated)."""
    return [build_stage(shape, j, num_stages, seed=0, device="meta").num_parameters() for j in range(num_stages)]


def step_profile(
    measurements: Sequence[ComputeMeasurement],
    train: TrainConfig,
    num_stages: int,
    num_replicas: int,
    *,
    boundary_s: float = 0.0,
    time_scale: float = 1.0,
    size_factor: float = 1.0,
    steps: int | None = None,
    verify: VerifyConfig | None = None,
) -> StepProfile:
    """The step profile of a plan of ``num_stages`` × ``num_replicas`` (module docstring), in the network's
    units. Without measurements, compute and message overhead are zero (communication only).
    ``boundary_s``: what an agent does between two steps (real seconds; the leader times its own polls);
    ``verify``: the run's checks, the sum check's messages and the recompute check's rate (``verify_volumes``)."""
    shape, m = train.shape, train.micro_batches
    params = stage_parameters(shape, num_stages)
    grads = [(p + (1 if j == num_stages - 1 else 0)) * FP32_BYTES / GB / size_factor for j, p in enumerate(params)]
    extra = (run_settings(train, size_factor) | verify_volumes(verify, train, num_stages, num_replicas, size_factor)
             | ({} if steps is None else {"steps": steps}))
    if not measurements:
        return StepProfile(micro_batches=m, gradient_gb=tuple(grads), boundary_s=boundary_s, **extra).scaled(
            1.0 / time_scale)
    rows = train.global_batch_size // (num_replicas * m)

    def median(get: Callable[[ComputeMeasurement], float]) -> float:
        # compute grows with the tokens of a micro-batch: scale from the rows each agent measured
        return statistics.median(get(c) * rows * shape.seq_len / (c.rows * c.seq_len) for c in measurements)

    layer = (median(lambda c: c.layer_s[0]), median(lambda c: c.layer_s[1]))
    embed = (median(lambda c: c.embed_s[0]), median(lambda c: c.embed_s[1]))
    head = (median(lambda c: c.head_s[0]), median(lambda c: c.head_s[1]))
    per_param = statistics.median(c.update_s_per_mparam for c in measurements) / 1e6
    message_s = statistics.median(c.message_s for c in measurements)
    forward, backward = [], []
    for j in range(num_stages):
        blocks = len(stage_layer_range(shape.num_layers, j, num_stages))
        ends = [embed] * (j == 0) + [head] * (j == num_stages - 1)
        forward.append(blocks * layer[0] + sum(e[0] for e in ends))
        backward.append(blocks * layer[1] + sum(e[1] for e in ends))
    checking = {"verify_compute_s": check_seconds(measurements, verify, train, params, num_replicas)} \
        if "verify_gb" in extra else {}
    profile = StepProfile(micro_batches=m, forward_s=tuple(forward), backward_s=tuple(backward),
                          update_s=tuple(p * per_param for p in params), gradient_gb=tuple(grads),
                          message_s=message_s, boundary_s=boundary_s, **extra, **checking,
                          **codec_costs(measurements, size_factor))
    return profile.scaled(1.0 / time_scale)


def check_seconds(measurements: Sequence[ComputeMeasurement], verify: VerifyConfig, train: TrainConfig,
                  params: Sequence[int], num_replicas: int) -> tuple[float, ...]:
    """The sum check's own work per member and step, per stage of ``params`` parameters, in real seconds
    (``check_s_per_parameter``)."""
    rate = check_s_per_parameter(measurements, verify, train, num_replicas)
    return tuple(rate * p for p in params)


def check_s_per_parameter(measurements: Sequence[ComputeMeasurement], verify: VerifyConfig, train: TrainConfig,
                          num_replicas: int) -> float:
    """The sum check's own work per member and step (``verify.sum_check``), real seconds per parameter of the
    member's stage: in a group of D, each member sketches (with their norms) its own shard's sum and the D
    contributions to it, and for each of the D − 1 other owners the difference of their sum and its own
    contribution (``sketch.difference_sketch``, about one sketch's work): 2 vectors of a stage's size, twice that
    with the running sums; and digests the D − 1 reduce shards it sent, its
    own sum, and the D − 1 shards and sums it received: (3D − 2)/D. At the members' median
    ``check_s_per_melement`` (0 from agents that predate it), the sketches scaled from the calibrated rows
    (``SKETCH_ROWS``) to the run's."""
    d = num_replicas
    sketch_s = statistics.median(c.check_s_per_melement[0] for c in measurements) * verify.sketch_rows / SKETCH_ROWS
    digest_s = statistics.median(c.check_s_per_melement[1] for c in measurements)
    sketched = 2 * (2 if runs_sums(verify.running, wire_format(train.wire).gradient.name) else 1)
    return (sketch_s * sketched + digest_s * (3 * d - 2) / d) / 1e6


def codec_costs(measurements: Sequence[ComputeMeasurement], size_factor: float = 1.0, time_scale: float = 1.0
                ) -> dict[str, tuple[float, float, float]]:
    """The wire codecs' encode and decode time (the median of the members' ``codec_s_per_melement``, an
    older agent's record counting 0) as ``StepProfile`` fields: seconds per GB of the workload's volume, whose
    GB hold GB · size_factor / 4 real float32 elements, in the network's seconds."""
    elements_per_gb = GB * size_factor / FP32_BYTES
    per_gb = [[statistics.median(c.codec_s_per_melement[kind][end] for c in measurements) * 1e-6 * elements_per_gb
               / time_scale if measurements else 0.0 for kind in range(3)] for end in range(2)]
    return {"encode_s_per_gb": tuple(per_gb[0]), "decode_s_per_gb": tuple(per_gb[1])}


def run_settings(train: TrainConfig, size_factor: float = 1.0) -> dict[str, object]:
    """What the run's settings change in a step, as ``StepProfile`` fields (``planning.wire_model``): the wire
    format (volumes here count float32 elements), the schedule, and the overlapped all-reduce's bucket size
    in the network's GB (0: one exchange after the backward pass), whether the stages exchange gradient norms
    to clip, and DiLoCo's rounds (their all-reduce overlapped with the next round or not)."""
    bucket_gb = train.bucket_elements * FP32_BYTES / GB / size_factor if train.overlap else 0.0
    return {"wire": train.wire, "schedule": train.schedule, "volume_bytes": (FP32_BYTES,) * 3, "bucket_gb": bucket_gb,
            "clip": train.optimizer.clip > 0, "sync_every": train.diloco.inner_steps if train.sync == "diloco" else 1,
            "sync_overlap": train.sync == "diloco" and train.diloco.overlap and train.diloco.inner_steps > 1,
            "overlap_steps": train.diloco.overlap_steps, "fragments": train.diloco.fragments}


def verify_volumes(verify: VerifyConfig | None, train: TrainConfig, num_stages: int, num_replicas: int,
                   size_factor: float = 1.0) -> dict[str, object]:
    """The sum check's messages (``verify.sum_check``: after each step's all-reduce every member of a stage's group
    sends every other member a signed ``commit`` statement, waits for theirs, then a ``sketch`` statement and
    waits for theirs) as the ``StepProfile`` field ``verify_gb``, in the network's GB (bytes / size_factor:
    the emulator shapes their real bytes as every message's). Their size grows with a stage's buckets: priced
    at the largest stage's of an even split. Nothing where no check runs: ``[verify]`` off, DiLoCo, one
    replica. Where the recompute check runs too (``agent.epoch._install_verifier``: two stages or more, not
    fp16), its ``[verify] rate`` times the verifiers of each member (``[verify] verifiers``, at most D - 1) as
    ``recompute_rate`` (the objective sizes its reveals from its own wire-format pipeline volumes)."""
    if verify is None or not verify.enabled or train.sync == "diloco" or num_replicas < 2:
        return {}
    shape = train.shape
    buckets = max(len(plan_buckets([p.numel() for p in build_stage(shape, j, num_stages, seed=0, device="meta")
                                    .parameters() if p.requires_grad], train.bucket_elements))
                  for j in range(num_stages))
    sizes = (commit_bytes(buckets, num_replicas),
             sketch_bytes(buckets, num_replicas, verify.sketch_rows, runs_sums(verify.running, wire_format(train.wire).gradient.name)))
    # each member's challenged micro-batches go to min(verifiers, D - 1) replicas: as many reveals and recomputes
    rate = min(1.0, float(verify.rate) * min(verify.verifiers, num_replicas - 1))
    recompute = {"recompute_rate": rate} if num_stages >= 2 and train.precision != "fp16" else {}
    return {"verify_gb": tuple(statement.wire_size(b) / GB / size_factor for b in sizes)} | recompute


def step_workload(workload: Workload, profile: StepProfile) -> StepWorkload:
    """``workload`` (c_PP, c_DP) carrying ``profile``, for ``make_objective("simulated", ...)``."""
    return StepWorkload(workload.activation_gb, workload.gradient_gb, workload.source, step=profile)


def expected_rows(train: TrainConfig, members: int) -> int:
    """Sequences per micro-batch of a plan over ``members`` peers (one replica if they are too few)."""
    replicas = max(1, members // train.stage_bounds[0])  # stages = "auto": as many replicas as the bounds allow
    while replicas > 1 and train.global_batch_size % (replicas * train.micro_batches):
        replicas -= 1
    return max(1, train.global_batch_size // (replicas * train.micro_batches))


# -- mixed devices: each device's own measurement -------------------------------------------------------------

SPEED_UNIT = 1e12  # measured speeds are block-tokens per second over 10¹² (a device's ``tflops`` field)


def _block_s(c: ComputeMeasurement) -> float:
    """A device's time for one block forward and backward at its measured rows (the ends if no block)."""
    return max(sum(c.layer_s) or (sum(c.embed_s) + sum(c.head_s)), 1e-9)


def measured_speed(c: ComputeMeasurement) -> float:
    """A device's measured speed: tokens a second through one block, forward and backward (over
    ``SPEED_UNIT``, the unit of a cluster device's ``tflops``; only ratios between devices matter)."""
    return c.rows * c.seq_len / _block_s(c) / SPEED_UNIT


def layered_workload(
    measurements: Sequence[ComputeMeasurement],
    workload: Workload,
    train: TrainConfig,
    num_replicas: int,
    *,
    boundary_s: float = 0.0,
    time_scale: float = 1.0,
    size_factor: float = 1.0,
    steps: int | None = None,
    verify: VerifyConfig | None = None,
) -> LayeredWorkload:
    """This run's workload priced per layer (``planning.joint``) from the trainers' own measurements:
    compute at the fastest device's speed (``measured_speed``; the others' are their devices' ``tflops``,
    ``with_measured_speeds``), gradients and memory of every part of the model, in the network's units.
    How a block's time divides into forward and backward, and what the embeddings, the head and the update
    take beside it, is the median over the devices of each one's ratio to its own block time (alike on
    every device; one device's differences of minima are noisy)."""
    if not measurements:
        raise ValueError("a layered workload needs at least one calibration")
    shape, m = train.shape, train.micro_batches
    fastest = max(measurements, key=measured_speed)
    rows = train.global_batch_size // (num_replicas * m)
    reference_s = _block_s(fastest) / time_scale  # at the fastest device's measured rows, network seconds
    grow = rows * shape.seq_len / (fastest.rows * fastest.seq_len)  # compute grows with the micro-batch

    def part(get: Callable[[ComputeMeasurement], float]) -> float:
        return statistics.median(get(c) / _block_s(c) for c in measurements) * reference_s

    model = layer_model(shape, micro_batch_tokens=rows * shape.seq_len, micro_batches=m, activation_bytes=FP32_BYTES,
                        recompute=train.activation_checkpointing)  # checkpointed stages keep block inputs only
    costs = LayerCosts(
        num_layers=shape.num_layers,
        forward_s=Parts(*(grow * part(get) for get in (lambda c: c.layer_s[0], lambda c: c.embed_s[0],
                                                        lambda c: c.head_s[0]))),
        backward_s=Parts(*(grow * part(get) for get in (lambda c: c.layer_s[1], lambda c: c.embed_s[1],
                                                         lambda c: c.head_s[1]))),
        update_s=model.parameters.scaled(part(lambda c: c.update_s_per_mparam / 1e6)),  # not grown: per parameter
        gradient_gb=model.parameters.scaled(FP32_BYTES / GB / size_factor),
        memory_gb=model.memory_bytes.scaled(1 / GB),
    )
    extra = (run_settings(train, size_factor)
             | verify_volumes(verify, train, train.stages if train.stages != "auto" else 1, num_replicas,
                              size_factor)  # the plan's S ("auto" is chosen before a plan is priced)
             | ({} if steps is None else {"steps": steps}))
    if "verify_gb" in extra:  # the sum check's own work, per parameter of a stage (not grown: per parameter)
        costs = dataclasses.replace(costs, verify_s=model.parameters.scaled(
            check_s_per_parameter(measurements, verify, train, num_replicas) / time_scale))
    step = StepProfile(micro_batches=m, message_s=statistics.median(c.message_s for c in measurements) / time_scale,
                       boundary_s=boundary_s / time_scale, reference_tflops=measured_speed(fastest), **extra,
                       **codec_costs(measurements, size_factor, time_scale))
    return LayeredWorkload(workload.activation_gb, workload.gradient_gb, workload.source, step=step, costs=costs,
                           wire="fp32")


def with_measured_speeds(cluster: Cluster, measurements: Sequence[ComputeMeasurement | None]) -> Cluster:
    """``cluster`` whose device i's ``tflops`` is ``measured_speed(measurements[i])``, when every device has
    one (the leader and the followers that check its plan price the same speeds); unchanged otherwise."""
    if len(measurements) != cluster.num_devices or any(c is None for c in measurements):
        return cluster
    devices = tuple(dataclasses.replace(d, tflops=measured_speed(c)) for d, c in zip(cluster.devices, measurements,
                                                                                      strict=True))
    return dataclasses.replace(cluster, devices=devices)
