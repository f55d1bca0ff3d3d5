"""Wire formats: how a run's tensors travel, chosen per run (``[train] wire`` / ``p2ptrain train --wire``).

One name picks the codec of each tensor kind the runtime sends (``WIRE_FORMATS``):

======  =====================  =====================  =====================================================
name    activations            activation gradients   data-parallel gradients (reduce-scatter, all-gather)
======  =====================  =====================  =====================================================
fp32    float32, 4 B/elem      float32, 4 B/elem      float32, 4 B/elem: exact, today's bytes bit for bit
bf16    bfloat16, 2 B/elem     bfloat16, 2 B/elem     bfloat16, 2 B/elem, with error feedback
int8    blockwise int8         blockwise int8         blockwise int8, with error feedback
int4    blockwise int4         blockwise int8         blockwise int4, with error feedback
======  =====================  =====================  =====================================================

Bytes per element on the wire (what a link carries; the transport's chunk headers aside), ``BLOCK`` = 64:

* ``fp32``: 4; ``bf16``: 2 (torch's bfloat16, round to nearest even);
* ``int8``: 1 + 4/64 = 1.0625 — per block of 64 elements one float32 scale (absmax / 127) and 64 signed
  codes in −127…127, rounded to nearest: ``|x − x̂| ≤ absmax_block / 254`` (plus float32 rounding);
* ``int4``: 0.5 + 4/64 = 0.5625 — per block one float32 scale (absmax / 7) and codes −7…7 packed two to a
  byte: ``|x − x̂| ≤ absmax_block / 14``.

An int8/int4 message is one flat ``uint8`` tensor: the ``ceil(n / 64)`` float32 scales first, then the codes
(``wire_bytes(name, n)``). ``fp32`` and ``bf16`` messages keep the tensor's shape.

Activations and their gradients are quantised as they are, without error feedback. AQ-SGD's delta coding
(send the change against the value last sent for the same sample, both ends keeping that reference) pays
when a sample comes back: in fine-tuning, epoch after epoch. Here every step draws fresh sequences, so the
reference of a micro-batch slot is another sequence's activation; measured on ``tiny`` (stage 0's output,
parameters fixed, ``wire_quality.delta_coding_error``) the change quantises with 0.95× the error of the value
itself — 5 % less error for a reference per slot and boundary on both ends (the very activation memory 1F1B
saves) that must also survive re-plans. Data-parallel gradients are the same quantity step after step, so
they get error feedback (``ErrorFeedback``): what a member's encoding dropped is added to its next step's
gradient (and, for the shard a member sums, what the all-gather's encoding dropped to its next sum).

What a cost model needs to know about a run's settings (``TrainConfig`` keys; flags of ``p2ptrain train``,
``swarm`` and ``agent``):

* ``wire`` (``--wire``): the table above; ``bytes_per_element(name)`` and ``wire_bytes(name, n)`` give the
  sizes, ``wire_format(name)`` the codec per kind. The loss (one float32 per step, last stage) is always fp32.
* ``schedule`` (``--schedule gpipe|1f1b``, default ``gpipe``): ``schedule.schedule_ops`` gives each stage's
  order of forwards and backwards; 1F1B runs ``min(S − 1 − j, M)`` warm-up forwards on stage j.
* ``overlap`` (``--overlap/--no-overlap``, default on) and ``bucket_elements`` (default 2^18): a stage's
  gradients are cut into buckets of about that many elements (reverse parameter order, a parameter never
  split); during the stage's last backward each bucket's sharded all-reduce (reduce-scatter then
  all-gather, both in the gradient codec) starts as soon as its gradients are final, up to
  ``buckets.MAX_BUCKETS_IN_FLIGHT`` (4) at once; without overlap the buckets start when backward ends. Each
  bucket's messages carry the bucket index as their micro-batch number; the loss goes as one more bucket.
  Sends never block compute: the compute thread waits only for what it receives.

Decoding is deterministic and every shard is summed in float32 by one member in replica order, then sent
encoded to all and decoded by all (its owner included): replicas apply bit-identical updates whatever the
wire. The codecs are pure torch functions. hivemind's compression is not used: its codecs produce protobuf
messages, and its blockwise 8-bit codec needs bitsandbytes; torch's own dtypes serve fp32 and bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

WireName = Literal["fp32", "bf16", "int8", "int4"]
WIRE_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
BLOCK = 64  # elements per quantisation block (one float32 scale each)
SCALE_BYTES = 4
_LEVELS = {"int8": 127, "int4": 7}


class WireError(ValueError):
    """A message that does not decode: wrong size or invalid scales."""


@dataclass(frozen=True)
class Codec:
    """Encoding of float32 tensors for one tensor kind: ``fp32``, ``bf16``, ``int8`` or ``int4``."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in WIRE_FORMATS:
            raise ValueError(f"unknown wire format {self.name!r} (known: {', '.join(WIRE_FORMATS)})")

    @property
    def exact(self) -> bool:
        return self.name == "fp32"

    def wire_spec(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of the message that carries a float32 tensor of ``shape``."""
        if self.name == "fp32":
            return tuple(shape), torch.float32
        if self.name == "bf16":
            return tuple(shape), torch.bfloat16
        return (wire_bytes(self.name, math.prod(shape)),), torch.uint8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (on the CPU, contiguous) of tensor ``x``, taken as float32. ``x`` may live on an
        accelerator: it is encoded there, so only the message's bytes cross to the host."""
        x = x.detach().to(torch.float32)
        if self.name == "fp32":
            return x.to("cpu").contiguous()
        if self.name == "bf16":
            return x.to(torch.bfloat16).to("cpu").contiguous()
        return quantise_blockwise(x.contiguous().reshape(-1), _LEVELS[self.name]).to("cpu")

    def decode(self, message: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor of ``shape`` that ``message`` carries; WireError if it cannot."""
        want_shape, want_dtype = self.wire_spec(shape)
        if tuple(message.shape) != want_shape or message.dtype != want_dtype:
            raise WireError(f"{self.name} message of {tuple(message.shape)} {message.dtype}, expected "
                            f"{want_shape} {want_dtype} for a tensor of {tuple(shape)}")
        if self.name == "fp32":
            return message
        if self.name == "bf16":
            return message.to(torch.float32)
        return dequantise_blockwise(message, math.prod(shape), _LEVELS[self.name]).reshape(shape)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what the receiver will hold."""
        return self.decode(self.encode(x), tuple(x.shape))


@dataclass(frozen=True)
class WireFormat:
    """The codec of each tensor kind of a run."""

    name: str
    activation: Codec
    activation_grad: Codec
    gradient: Codec  # data-parallel gradients


def wire_format(name: str) -> WireFormat:
    """The run's codecs for wire ``name``; ValueError (one line) for an unknown name."""
    if name not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {name!r} (known: {', '.join(WIRE_FORMATS)})")
    backward = "int8" if name == "int4" else name  # 4-bit gradients through the pipeline lose too much
    return WireFormat(name, Codec(name), Codec(backward), Codec(name))


def bytes_per_element(name: str) -> float:
    """Wire bytes per float32 element of codec ``name``, scale overhead included (for cost models)."""
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1 + SCALE_BYTES / BLOCK, "int4": 0.5 + SCALE_BYTES / BLOCK}[name]


def wire_bytes(name: str, numel: int) -> int:
    """The exact size in bytes of codec ``name``'s message for ``numel`` elements."""
    if name in ("fp32", "bf16"):
        return numel * (4 if name == "fp32" else 2)
    blocks = -(-numel // BLOCK)
    codes = numel if name == "int8" else -(-numel // 2)
    return blocks * SCALE_BYTES + codes


def quantise_blockwise(flat: torch.Tensor, levels: int) -> torch.Tensor:
    """``flat`` (1-D float32) as one uint8 message: per block of ``BLOCK`` a float32 scale, then the codes
    (int8 for ``levels`` 127, packed nibbles for ``levels`` 7); rounded to nearest."""
    numel = flat.numel()
    blocks = -(-numel // BLOCK)
    head = blocks * SCALE_BYTES
    message = torch.empty(head + (numel if levels == 127 else -(-numel // 2)), dtype=torch.uint8, device=flat.device)
    view = _blocks(flat, blocks)
    absmax = view.abs().amax(dim=1)
    torch.div(absmax, levels, out=message[:head].view(torch.float32))
    inverse = torch.where(absmax > 0, levels / absmax, torch.zeros_like(absmax))
    codes = (view * inverse[:, None]).round_().clamp_(-levels, levels).reshape(-1)[:numel].to(torch.int8)
    if levels == 7:
        nibbles = (codes + 8).to(torch.uint8)  # 1 … 15
        if numel % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8, device=flat.device)])
        torch.bitwise_or(nibbles[0::2], nibbles[1::2] << 4, out=message[head:])
    else:
        message[head:] = codes.view(torch.uint8)
    return message


def dequantise_blockwise(message: torch.Tensor, numel: int, levels: int) -> torch.Tensor:
    """The inverse of ``quantise_blockwise``: a 1-D float32 tensor of ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    scales = message[: blocks * SCALE_BYTES].clone().view(torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError("quantised message with a negative or non-finite scale")
    payload = message[blocks * SCALE_BYTES:]
    if levels == 7:
        codes = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:numel].to(torch.float32) - 8
    else:
        codes = payload.view(torch.int8).to(torch.float32)
    return (_blocks(codes, blocks) * scales[:, None]).reshape(-1)[:numel]


def _blocks(flat: torch.Tensor, blocks: int) -> torch.Tensor:
    """``flat`` as ``[blocks, BLOCK]``, zero-padded at the end when its size is not a multiple of BLOCK."""
    if flat.numel() == blocks * BLOCK:
        return flat.view(blocks, BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(blocks, BLOCK)


class ErrorFeedback:
    """Residuals of a lossy codec, kept per key (a bucket, or a bucket's shard): ``encode`` sends
    ``x + residual`` and keeps what the encoding dropped for the next call with the same key.

    The residuals are local state: replicas keep different ones, and they are not checkpointed (a re-plan
    or restart starts from zero, a one-step perturbation of the size of one quantisation error).
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residuals: dict[object, torch.Tensor] = {}

    def encode(self, key: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The message for ``x`` compensated by the key's residual, and its decoded value."""
        if self.codec.exact:
            return self.codec.encode(x), x
        residual = self.residuals.get(key)
        corrected = x if residual is None or residual.shape != x.shape else x + residual
        message = self.codec.encode(corrected)
        decoded = self.codec.decode(message, tuple(x.shape))
        self.residuals[key] = corrected - decoded
        return message, decoded
