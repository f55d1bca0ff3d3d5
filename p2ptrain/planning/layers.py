"""The workload per layer: what each block, the embeddings and the head cost, so that a plan can cut a
model into stages of any layer counts and check that every stage fits its devices' memory.

A stage holding blocks [a, b) costs (b − a) blocks, plus the embeddings on stage 0 and the head (final
norm, LM head, loss) on the last stage. Every per-part figure is a ``Parts`` triple (block,
embeddings, head), so one formula prices any split (``Parts.stage``).

Derivations, for a model of L blocks, width h, a heads, key/value width kv (h without grouped-query
attention), MLP width f, sequence length T, vocabulary V, a micro-batch of n tokens (``micro_batch_tokens``),
M micro-batches per pipeline and step; a gpt has f = 4h and kv = h:

- Parameters (``workload.block_parameters``, ``embedding_parameters``, ``head_parameters``): a gpt block
  12h² + 13h, its embeddings V·h + T·h, its head 2h + h·V; a llama block h·(h + 2kv) + h² + 3·h·f + 2h (no
  biases, RMSNorm gains only), its embeddings V·h (rotary positions have no parameters), its head h + h·V.
- Forward FLOPs of one micro-batch: a block's matrix products are its weights' count in multiply-adds
  per token (``workload.block_matmul_parameters``: gpt 12h², q, k, v and the output projection 4h², the
  MLP 8h²; llama h·(h + 2kv) + h² + 3·h·f), attention scores and their weighted sum 2·T·h more (causal
  masking computes the full T×T product; grouped-query attention shares keys, not the products):
  2·n·(matmul weights + 2Th). The head 2·n·h·V; the embeddings a lookup (0). The backward pass is twice the
  forward (a gradient for the input and one for the weights), plus one forward again with ``recompute``.
- Training state: 16 bytes per parameter whatever the precision — fp32 weights, gradients and AdamW's two
  moments (4 + 4 + 8; our runtime), or fp16 weights and gradients with fp32 master weights and moments
  (2 + 2 + 4 + 8; mixed precision as the paper trained). DiLoCo's outer optimizer keeps two more float32
  copies, the round's anchor and its momentum, in host memory (``model.outer``): 8 bytes a parameter of the
  host's, none of the card's.
- Activations kept for the backward pass, per token of a micro-batch: a gpt block 34h + 5aT bytes with
  2-byte activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 2: norms 4h, attention 11h + 5aT, MLP 19h = its input 2h, GELU's input and output 2·2·4h,
  a dropout mask h), generally 18h + 4f + 5aT; a llama block the same norms and attention and a SwiGLU MLP
  keeping its input 2h and four f-wide tensors (gate, up, silu(gate), their product) 8f: 17h + 8f + 5aT;
  scaled by activation_bytes / 2. The head keeps the final norm's input and output (2h values)
  and the fp32 logits and their softmax (8V bytes); the embeddings nothing (the first block counts its own
  input). GPipe runs all M forward passes before the first backward, so a stage holds M micro-batches'
  activations at its peak; 1F1B at most S − j on stage j, min(S, M) on stage 0, which ``model_workload``
  charges every stage (``in_flight``: an upper bound, exact for stage 0). With ``recompute`` (activation
  checkpointing) a block keeps only its input (h values per token) for each micro-batch, plus one
  micro-batch's full working set while it recomputes (the head likewise: its input for every micro-batch,
  its logits for one at a time).

Units: GB is 10⁹ bytes. Times: ``compute_parts`` (FLOPs over a device's speed) or measured
(``runtime.calibration``).

What the planner prices (``planning.joint``): ``LayerCosts``, the parts in the network's units (seconds of
one micro-batch on the reference device, GB of gradients, GB of memory), and ``LayeredWorkload``, a step
workload that gives the per-stage profile of any split (``at``); ``model_workload`` builds one from a
model shape and a cluster's cards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.simulated import StepProfile, StepWorkload
from p2ptrain.planning.split import Layers, even_layers
from p2ptrain.planning.workload import (
    block_matmul_parameters,
    block_parameters,
    embedding_parameters,
    head_parameters,
)

GB = 1e9
STATE_BYTES_PER_PARAMETER = 16
BACKWARD_FLOPS_PER_FORWARD = 2.0
# Achieved fraction of a card's peak FLOP/s in training (model FLOPs utilisation): 0.35 is typical of
# well-tuned GPT training on data-centre and consumer GPUs alike (Narayanan et al. 2021 report 44-52 %
# with Megatron at scale; smaller per-device batches get less). Only the ratio to the network matters.
DEFAULT_UTILISATION = 0.35
PAPER_DEVICE_TFLOPS = 125.0  # the paper's V100: fp16 tensor-core peak (NVIDIA V100 data sheet)


@dataclass(frozen=True)
class Parts:
    """One quantity per part of the model: a block, the embeddings (stage 0), the head (last stage)."""

    block: float
    embeddings: float = 0.0
    head: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block", "embeddings", "head"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"layer parts: {name} must be a non-negative number, got {v!r}")

    def stage(self, blocks: int, first: bool, last: bool) -> float:
        """The quantity for a stage of ``blocks`` blocks (with the embeddings if first, the head if last)."""
        return blocks * self.block + (self.embeddings if first else 0.0) + (self.head if last else 0.0)

    def scaled(self, factor: float) -> Parts:
        return Parts(self.block * factor, self.embeddings * factor, self.head * factor)


@dataclass(frozen=True)
class LayerModel:
    """What every part of a model costs for one plan shape (module docstring): parameters, forward FLOPs of
    one micro-batch, and device memory at the stage's peak (training state + activations of M
    micro-batches) in bytes."""

    num_layers: int
    parameters: Parts
    forward_flops: Parts
    memory_bytes: Parts
    micro_batches: int
    stage_extra_bytes: float = 0.0  # on every stage whatever it holds (a recomputation's working set)
    recompute: bool = False  # activation checkpointing: the backward pass runs the forward again

    def stage_memory_gb(self, layers: tuple[tuple[int, int], ...]) -> tuple[float, ...]:
        """Peak memory of each stage of the split ``layers`` ([a, b) per stage), in GB."""
        last = len(layers) - 1
        return tuple((self.memory_bytes.stage(b - a, j == 0, j == last) + self.stage_extra_bytes) / GB
                     for j, (a, b) in enumerate(layers))

    def stage_parameters(self, layers: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
        last = len(layers) - 1
        return tuple(int(self.parameters.stage(b - a, j == 0, j == last)) for j, (a, b) in enumerate(layers))


def layer_model(
    shape: ModelShape,
    *,
    micro_batch_tokens: float,
    micro_batches: int,
    activation_bytes: int = 2,
    recompute: bool = False,
    state_bytes: float = STATE_BYTES_PER_PARAMETER,
) -> LayerModel:
    """The per-part costs of ``shape`` for micro-batches of ``micro_batch_tokens`` tokens, a stage holding
    ``micro_batches`` of them at its peak and ``state_bytes`` per parameter (module docstring)."""
    if micro_batch_tokens <= 0 or micro_batches < 1 or activation_bytes < 1 or state_bytes <= 0:
        raise ValueError("layer model: micro_batch_tokens, micro_batches, activation_bytes and state_bytes must be "
                         "positive")
    h, a, t, v, n = shape.hidden_size, shape.num_heads, shape.seq_len, shape.vocab_size, micro_batch_tokens
    f = shape.ffn_hidden_size
    params = Parts(block=block_parameters(shape), embeddings=embedding_parameters(shape), head=head_parameters(shape))
    flops = Parts(block=2 * n * (block_matmul_parameters(shape) + 2 * t * h), embeddings=0.0, head=2 * n * h * v)
    per_token = 17 * h + 8 * f if shape.family == "llama" else 18 * h + 4 * f  # 34h for a gpt with f = 4h
    full_block = n * (per_token + 5 * a * t) * activation_bytes / 2
    if recompute:
        kept_block, transient = n * h * activation_bytes * micro_batches, full_block
    else:
        kept_block, transient = full_block * micro_batches, 0.0
    head_full = n * (2 * h * activation_bytes + 8 * v)
    head_acts = n * h * activation_bytes * micro_batches + head_full if recompute else head_full * micro_batches
    memory = Parts(
        block=state_bytes * params.block + kept_block,
        embeddings=state_bytes * params.embeddings,
        head=state_bytes * params.head + head_acts,
    )
    return LayerModel(shape.num_layers, params, flops, memory, micro_batches, stage_extra_bytes=transient,
                      recompute=recompute)


def compute_parts(model: LayerModel, reference_tflops: float, utilisation: float = DEFAULT_UTILISATION
                  ) -> tuple[Parts, Parts]:
    """Forward and backward seconds of one micro-batch per part on a device of ``reference_tflops`` peak."""
    if not (reference_tflops > 0 and 0 < utilisation <= 1):
        raise ValueError("compute: reference_tflops must be positive and utilisation in (0, 1]")
    forward = model.forward_flops.scaled(1.0 / (reference_tflops * 1e12 * utilisation))
    return forward, forward.scaled(BACKWARD_FLOPS_PER_FORWARD + (1.0 if model.recompute else 0.0))


@dataclass(frozen=True)
class LayerCosts:
    """Per-part costs (``layers.Parts``: a block, the embeddings, the head) in the network's units:
    seconds of one micro-batch on the reference device, GB of gradients on the wire, GB of device memory
    (plus ``stage_memory_gb`` on every stage)."""

    num_layers: int
    forward_s: Parts
    backward_s: Parts
    update_s: Parts
    gradient_gb: Parts
    memory_gb: Parts
    stage_memory_gb: float = 0.0
    verify_s: Parts | None = None  # the sum check's own work a step (``StepProfile.verify_compute_s``); None: none

    def per_stage(self, parts: Parts, layers: Layers) -> tuple[float, ...]:
        last = len(layers) - 1
        return tuple(parts.stage(b - a, j == 0, j == last) for j, (a, b) in enumerate(layers))

    def memory(self, layers: Layers) -> tuple[float, ...]:
        """Peak memory of each stage of ``layers`` on each of its devices, GB."""
        return tuple(m + self.stage_memory_gb for m in self.per_stage(self.memory_gb, layers))

    def profile(self, base: StepProfile, layers: Layers) -> StepProfile:
        """``base`` with the per-stage compute, update, gradients and sum check of the split ``layers``."""
        checks = {} if self.verify_s is None else {"verify_compute_s": self.per_stage(self.verify_s, layers)}
        return dataclasses.replace(
            base, forward_s=self.per_stage(self.forward_s, layers), backward_s=self.per_stage(self.backward_s, layers),
            update_s=self.per_stage(self.update_s, layers), gradient_gb=self.per_stage(self.gradient_gb, layers),
            **checks)


@dataclass(frozen=True)
class LayeredWorkload(StepWorkload):
    """A step workload priced per layer, so that the planner chooses the split (``costs``); ``step`` holds
    what does not depend on it (micro-batches, message overhead, pause between steps, reference speed).
    ``wire``: the activations' format on the wire the volumes were computed for."""

    costs: LayerCosts | None = None
    wire: str = "fp32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.costs is None:
            raise ValueError("a layered workload needs its layer costs")

    def at(self, layers: Layers) -> StepWorkload:
        """The plain step workload of the split ``layers``."""
        assert self.costs is not None
        profile = self.costs.profile(self.step, layers)
        return StepWorkload(self.activation_gb, max(profile.gradient_gb), self.source, step=profile)


def model_workload(
    shape: ModelShape,
    cluster: Cluster,
    *,
    num_stages: int,
    batch_tokens: int,
    micro_batches: int,
    activation_bytes: int = 2,
    gradient_bytes: int = 4,
    recompute: bool = False,
    utilisation: float = DEFAULT_UTILISATION,
    source: str = "model",
    in_flight: int | None = None,
    state_bytes: float = STATE_BYTES_PER_PARAMETER,
) -> LayeredWorkload:
    """The layered workload of ``shape`` on ``cluster`` (``layers``: FLOPs over peak speed × utilisation).

    The reference device is the cluster's fastest; a device without ``tflops`` counts as the reference (with
    no speeds known at all, every device is the paper's V100). The optimizer update is left out (memory
    bound, small beside forward and backward on a GPU). Memory: ``in_flight`` micro-batches' activations on
    every stage (default all M, GPipe's peak; ``micro_batches_in_flight`` gives the schedule's) and
    ``state_bytes`` per parameter."""
    replicas = cluster.num_devices // num_stages
    shard_tokens = batch_tokens / replicas
    model = layer_model(shape, micro_batch_tokens=shard_tokens / micro_batches,
                        micro_batches=micro_batches if in_flight is None else in_flight,
                        activation_bytes=activation_bytes, recompute=recompute, state_bytes=state_bytes)
    speeds = [d.tflops for d in cluster.devices if d.tflops]
    reference = max(speeds) if speeds else PAPER_DEVICE_TFLOPS
    forward, backward = compute_parts(model, reference, utilisation)
    costs = LayerCosts(
        num_layers=shape.num_layers, forward_s=forward, backward_s=backward, update_s=Parts(0.0),
        gradient_gb=model.parameters.scaled(gradient_bytes / GB), memory_gb=model.memory_bytes.scaled(1 / GB),
        stage_memory_gb=model.stage_extra_bytes / GB)
    return LayeredWorkload(
        activation_gb=shard_tokens * shape.boundary_width * activation_bytes / GB,
        gradient_gb=parameter_gb(costs, num_stages), source=source,
        step=StepProfile(micro_batches=micro_batches, reference_tflops=reference), costs=costs,
        wire={2: "fp16", 4: "fp32"}.get(activation_bytes, f"{activation_bytes}-byte"))


def micro_batches_in_flight(schedule: str, num_stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak, the most any stage holds (stage 0):
    GPipe all M; 1F1B (PipeDream-flush) min(S, M)."""
    return min(num_stages, micro_batches) if schedule == "1f1b" else micro_batches


def parameter_gb(costs: LayerCosts, num_stages: int) -> float:
    """The largest stage's gradients under the even split (the workload's c_DP, for the paper's cost)."""
    return max(costs.per_stage(costs.gradient_gb, even_layers(costs.num_layers, num_stages)))
