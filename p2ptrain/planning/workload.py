"""The workload: how many bytes cross a stage boundary (c_PP) and how many a stage all-reduces (c_DP).

Derivation, for a GPT cut into S stages of equal layer counts and a global batch of B tokens split into
D_dp data shards:

- c_PP, the activations one shard sends across one stage boundary: every token of the shard leaves the
  stage as one hidden vector, so c_PP = (B / D_dp) · boundary_width · activation_bytes (``hidden_size``, or a
  subspace's k: ``model.subspace``). The same volume comes
  back as activation gradients in the backward pass; the cost model counts that (its factor 2).
- c_DP, one stage's gradients: the stage's parameters times gradient_bytes. As in the paper, the model's
  parameters are spread evenly over the stages (params / S), ignoring that stage 0 also holds the
  embeddings and the last stage the head.

Units: GB here means 10⁹ bytes, so that 8·c Gbit over β Gbit/s is seconds. The paper's public scheduler
used c_PP = 0.471249 and c_DP = 0.65 (its c_PP is 2024·2048·2 bytes × 61.04 sequences / 2³⁰, a GiB figure
with a typo'd 2024); ``PAPER_WORKLOAD`` keeps those constants unchanged so that our costs can be compared
with the paper's, and it is the default workload of ``p2ptrain plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.planning.model_shapes import ModelShape

GB = 1e9  # bytes


@dataclass(frozen=True)
class Workload:
    """Communication volumes in GB (10⁹ bytes): c_PP = ``activation_gb``, c_DP = ``gradient_gb``."""

    activation_gb: float
    gradient_gb: float
    source: str = "explicit"

    def __post_init__(self) -> None:
        for name in ("activation_gb", "gradient_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"workload: {name} must be a non-negative number of GB, got {v!r}")

    def with_overrides(self, activation_gb: float | None = None, gradient_gb: float | None = None) -> Workload:
        """This workload with either volume replaced (None keeps it)."""
        if activation_gb is None and gradient_gb is None:
            return self
        return Workload(
            activation_gb=self.activation_gb if activation_gb is None else activation_gb,
            gradient_gb=self.gradient_gb if gradient_gb is None else gradient_gb,
            source=f"{self.source} with overrides",
        )


PAPER_WORKLOAD = Workload(activation_gb=0.471249, gradient_gb=0.65, source="paper (GPT-3 XL, DT-FM constants)")
PAPER_BATCH_TOKENS = 1_000_000  # the paper's global batch: about 10⁶ tokens a step


def block_matmul_parameters(shape: ModelShape) -> int:
    """The weights of one block's matrix products (its multiply-adds per token): h·(h + 2kv) + h·w plus
    h·f + f·w (gpt) or 2·h·f + f·w (llama), w the width the two projections write (``boundary_width``: h, or a
    subspace's k, whose block also lifts its k coefficients to h twice: 2·k·h more multiply-adds, no weights
    of its own but counted here as the work they are)."""
    h, kv, f, w = shape.hidden_size, shape.kv_size, shape.ffn_hidden_size, shape.boundary_width
    lifts = 2 * shape.subspace * h
    return h * (h + 2 * kv) + h * w + (2 if shape.family == "llama" else 1) * h * f + f * w + lifts


def block_parameters(shape: ModelShape) -> int:
    """Parameters of one block of ``shape`` (h wide, q = h, kv = ``kv_size``, f = ``ffn_hidden_size``).

    Attention: q, k and v in one projection h·(h + 2kv), the output projection h·h. MLP: gpt h·f + f·h,
    llama (SwiGLU: gate, up, down) 3·h·f. Norms: gpt two LayerNorms (gain and bias, 4h), llama two RMSNorms
    (gain only, 2h). gpt's biases: h + 2kv on qkv, h on the output, f + h on the MLP. So gpt with kv = h and
    f = 4h: 12h² + 13h.
    """
    h, kv, f, w = shape.hidden_size, shape.kv_size, shape.ffn_hidden_size, shape.boundary_width
    matmuls = block_matmul_parameters(shape) - 2 * shape.subspace * h  # the lifts' work is no weight
    if shape.family == "llama":
        return matmuls + 2 * h
    return matmuls + (h + 2 * kv) + w + f + w + 4 * h


def embedding_parameters(shape: ModelShape) -> int:
    """Stage 0's lookups: token embeddings V·h, plus gpt's learned positions T·h (llama's are rotary); with a
    subspace the learned parts are k wide (the fixed ones are no parameters)."""
    h = shape.boundary_width
    return shape.vocab_size * h + (shape.seq_len * h if shape.family == "gpt" else 0)


def head_parameters(shape: ModelShape) -> int:
    """The last stage's final norm (gpt 2h, llama h) and untied LM head (h·V, no bias)."""
    h = shape.hidden_size
    return (2 * h if shape.family == "gpt" else h) + h * shape.vocab_size


def parameter_count(shape: ModelShape) -> int:
    """Parameters of the model ``shape`` describes: L blocks, the embeddings and the head (untied).

    For a gpt of width h, MLP 4h, vocabulary V and T positions: L·(12h² + 13h) + V·h + T·h + 2h + h·V.
    """
    return shape.num_layers * block_parameters(shape) + embedding_parameters(shape) + head_parameters(shape)


def workload_from_model(
    shape: ModelShape,
    *,
    num_stages: int,
    num_replicas: int,
    batch_tokens: int = PAPER_BATCH_TOKENS,
    activation_bytes: int = 2,
    gradient_bytes: int = 4,
    source: str = "model",
) -> Workload:
    """c_PP and c_DP for ``shape`` cut into ``num_stages`` stages, ``num_replicas`` data shards.

    ``activation_bytes`` is the size of one activation value on the wire (2: fp16/bf16), ``gradient_bytes``
    of one gradient value in the all-reduce (4: fp32). See the module docstring for the derivation.
    """
    for name, value in (
        ("num_stages", num_stages),
        ("num_replicas", num_replicas),
        ("batch_tokens", batch_tokens),
        ("activation_bytes", activation_bytes),
        ("gradient_bytes", gradient_bytes),
    ):
        if value <= 0:
            raise ValueError(f"workload: {name} must be positive, got {value}")
    if num_stages > shape.num_layers:
        raise ValueError(f"workload: {num_stages} stages but the model has only {shape.num_layers} layers")
    tokens_per_shard = batch_tokens / num_replicas
    return Workload(
        activation_gb=tokens_per_shard * shape.boundary_width * activation_bytes / GB,
        gradient_gb=parameter_count(shape) / num_stages * gradient_bytes / GB,
        source=source,
    )
