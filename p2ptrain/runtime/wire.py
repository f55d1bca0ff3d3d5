"""Wire formats: how a run's tensors travel, chosen per run (``[train] wire`` / ``p2ptrain train --wire``).

One name picks the codec of each tensor kind the runtime sends (``WIRE_FORMATS``; codecs: ``CODECS``):

========  ================  ====================  ==========================================================
name      activations       activation gradients  data-parallel gradients (reduce-scatter, all-gather) and
                                                  DiLoCo's pseudo-gradients
========  ================  ====================  ==========================================================
fp32      float32           float32               float32: exact, today's bytes bit for bit
bf16      bfloat16          bfloat16              bfloat16, with error feedback
int8      int8              int8                  int8, with error feedback
int4      int4              int8                  int4, with error feedback
int4_all  int4              int4                  int4, with error feedback
int2      int2              int4                  int2, with error feedback
========  ================  ====================  ==========================================================

Bytes per element on the wire (what a link carries; the transport's chunk headers aside), ``BLOCK`` = 64:

* ``fp32``: 4; ``bf16``: 2 (torch's bfloat16, round to nearest even);
* ``int8``: 1 + 4/64 = 1.0625 — per block of 64 elements one float32 scale (absmax / 127) and 64 signed
  codes in −127…127, rounded to nearest: ``|x − x̂| ≤ absmax_block / 254`` (plus float32 rounding);
* ``int4``: 0.5 + 4/64 = 0.5625 — per block one float32 scale (absmax / 7) and codes −7…7 packed two to a
  byte: ``|x − x̂| ≤ absmax_block / 14``;
* ``int2``: 0.25 + 4/64 = 0.3125 — per block one float32 step α and 2-bit codes, four to a byte, for the
  levels −3α, −α, α, 3α; α is whichever of absmax × (1/6, 5/24, 1/4, 7/24, 1/3) (``INT2_SCALES``) gives the
  block the least squared error: ``|x − x̂| ≤ max(α, absmax_block − 3α) ≤ absmax_block / 2``. On Gaussian
  data that is 0.34 relative error, Lloyd–Max's optimum for four levels (0.343);
* ``topk`` (in no wire: measured, see below): (4 + 2·8) / 256 = 0.078125 — per block of 256 elements
  (``TOPK_BLOCK``) the 8 of largest magnitude (``TOPK_KEEP``; all of a shorter tail's, up to 8), as one
  float32 scale (their absmax / 127), 8 int8 codes and 8 uint8 positions in increasing order: a kept element
  within ``absmax_block / 254``, a dropped one decodes to 0, exactly what error feedback keeps;
* ``lowrank`` (in no wire: measured, see below): rank r = ⌈d / 16⌉ float32 factors of an activation taken
  as a [tokens, d] matrix (randomised SVD from a fixed seed, two power steps), 4·r·(tokens + d) bytes
  (``lowrank_bytes``), exact on a matrix of rank r.

A quantised message is one flat ``uint8`` tensor: the float32 scales first, then the codes (then, for
``topk``, the positions); its size follows from the tensor's shape alone (``message_bytes(name, shape)``;
``wire_bytes(name, n)`` for n elements). ``fp32`` and ``bf16`` messages keep the tensor's shape.

Why these codecs, and not top-k, low-rank or delta coding, measured: docs/wire.md, "Why these codecs".

What a cost model needs to know about a run's settings (``TrainConfig`` keys; flags of ``p2ptrain train``,
``swarm`` and ``agent``):

* ``wire`` (``--wire``): the table above; ``bytes_per_element(name)``, ``wire_bytes(name, n)`` and
  ``message_bytes(name, shape)`` give a codec's sizes, ``wire_format(name)`` the codec per kind. The loss
  (one float32 per step, last stage) is always fp32.
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
wire. The codecs are pure torch functions (not hivemind's: docs/wire.md says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

WireName = Literal["fp32", "bf16", "int8", "int4", "int4_all", "int2"]
# the codec of each kind: (activations, activation gradients, data-parallel gradients and pseudo-gradients)
_KINDS: dict[str, tuple[str, str, str]] = {
    "fp32": ("fp32", "fp32", "fp32"),
    "bf16": ("bf16", "bf16", "bf16"),
    "int8": ("int8", "int8", "int8"),
    "int4": ("int4", "int8", "int4"),
    "int4_all": ("int4", "int4", "int4"),
    "int2": ("int2", "int4", "int2"),
}
WIRE_FORMATS: tuple[str, ...] = tuple(_KINDS)
CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "int2", "topk", "lowrank")
BLOCK = 64  # elements per quantisation block (one float32 scale each)
SCALE_BYTES = 4
_LEVELS = {"int8": 127, "int4": 7}
INT2_SCALES = (1 / 6, 5 / 24, 1 / 4, 7 / 24, 1 / 3)  # int2's candidate steps, times the block's absmax
CHUNK_BLOCKS = 4096  # blocks a quantiser works on at a time: 1 MiB of float32, which stays in cache over its passes
# The quantisers pack and unpack codes by viewing bytes as int16/int32, the first code in the low byte: a
# little-endian host's order (the messages' float32 scales are the host's own bytes too).
TOPK_BLOCK, TOPK_KEEP = 256, 8  # topk: the 8 largest of each 256 elements (1/32), uint8 indices
LOWRANK_DIVISOR = 16  # lowrank: rank ceil(d / 16) of a [tokens, d] activation
_POWER_STEPS = 2


class WireError(ValueError):
    """A message that does not decode: wrong size, invalid scales or indices."""


@dataclass(frozen=True)
class Codec:
    """Encoding of float32 tensors for one tensor kind: one of ``CODECS``."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r} (known: {', '.join(CODECS)})")

    @property
    def exact(self) -> bool:
        return self.name == "fp32"

    def wire_spec(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of the message that carries a float32 tensor of ``shape``."""
        if self.name == "fp32":
            return tuple(shape), torch.float32
        if self.name == "bf16":
            return tuple(shape), torch.bfloat16
        return (message_bytes(self.name, tuple(shape)),), torch.uint8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (on the CPU, contiguous) of tensor ``x``, taken as float32. ``x`` may live on an
        accelerator: it is encoded there, so only the message's bytes cross to the host."""
        x = x.detach().to(torch.float32)
        if self.name == "fp32":
            return x.to("cpu").contiguous()
        if self.name == "bf16":
            return x.to(torch.bfloat16).to("cpu").contiguous()
        if self.name == "lowrank":
            return encode_lowrank(x.contiguous().reshape(-1, x.shape[-1] if x.dim() else 1)).to("cpu")
        flat = x.contiguous().reshape(-1)
        if self.name == "int2":
            return quantise_2bit(flat).to("cpu")
        if self.name == "topk":
            return encode_topk(flat).to("cpu")
        return quantise_blockwise(flat, _LEVELS[self.name]).to("cpu")

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
        numel = math.prod(shape)
        if self.name == "lowrank":
            d = shape[-1] if shape else 1
            return decode_lowrank(message, numel // d if d else 0, d).reshape(shape)
        if self.name == "int2":
            return dequantise_2bit(message, numel).reshape(shape)
        if self.name == "topk":
            return decode_topk(message, numel).reshape(shape)
        return dequantise_blockwise(message, numel, _LEVELS[self.name]).reshape(shape)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what the receiver will hold."""
        return self.decode(self.encode(x), tuple(x.shape))


@dataclass(frozen=True)
class WireFormat:
    """The codec of each tensor kind of a run."""

    name: str
    activation: Codec
    activation_grad: Codec
    gradient: Codec  # data-parallel gradients, and DiLoCo's pseudo-gradients


def wire_format(name: str) -> WireFormat:
    """The run's codecs for wire ``name``; ValueError (one line) for an unknown name."""
    if name not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {name!r} (known: {', '.join(WIRE_FORMATS)})")
    return WireFormat(name, *(Codec(codec) for codec in _KINDS[name]))


def bytes_per_element(name: str) -> float:
    """Wire bytes per float32 element of codec ``name``, scale and index overhead included (for cost models);
    ``lowrank``'s depend on the shape (``lowrank_bytes``)."""
    per_element = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + SCALE_BYTES / BLOCK,
                   "int4": 0.5 + SCALE_BYTES / BLOCK, "int2": 0.25 + SCALE_BYTES / BLOCK,
                   "topk": (SCALE_BYTES + 2 * TOPK_KEEP) / TOPK_BLOCK}
    if name not in per_element:
        raise ValueError(f"codec {name!r} has no fixed bytes per element (known: {', '.join(per_element)})")
    return per_element[name]


def wire_bytes(name: str, numel: int) -> int:
    """The exact size in bytes of codec ``name``'s message for ``numel`` elements (``lowrank``: a vector)."""
    return message_bytes(name, (numel,))


def message_bytes(name: str, shape: tuple[int, ...]) -> int:
    """The exact size in bytes of codec ``name``'s message for a float32 tensor of ``shape``."""
    numel = math.prod(shape)
    if name in ("fp32", "bf16"):
        return numel * (4 if name == "fp32" else 2)
    if name == "topk":
        full, tail = divmod(numel, TOPK_BLOCK)
        return full * (SCALE_BYTES + 2 * TOPK_KEEP) + (SCALE_BYTES + 2 * min(tail, TOPK_KEEP) if tail else 0)
    if name == "lowrank":
        d = shape[-1] if shape else 1
        return lowrank_bytes(numel // d if d else 0, d)
    blocks = -(-numel // BLOCK)
    codes = {"int8": numel, "int4": -(-numel // 2), "int2": -(-numel // 4)}[name]
    return blocks * SCALE_BYTES + codes


def lowrank_rank(d: int) -> int:
    """``lowrank``'s rank for rows of ``d`` elements."""
    return -(-d // LOWRANK_DIVISOR)


def lowrank_bytes(rows: int, d: int) -> int:
    """``lowrank``'s message for a [rows, d] matrix: float32 factors [rows, r] and [r, d]."""
    return 4 * lowrank_rank(d) * (rows + d)


def quantise_blockwise(flat: torch.Tensor, levels: int) -> torch.Tensor:
    """``flat`` (1-D float32) as one uint8 message: per block of ``BLOCK`` a float32 scale, then the codes
    (int8 for ``levels`` 127, packed nibbles for ``levels`` 7); rounded to nearest.

    Works through ``CHUNK_BLOCKS`` blocks at a time in buffers it reuses: the operations a whole-tensor pass
    would do, on the same values (so the same bytes, ``tests/runtime/test_wire_identity.py``), while the
    chunk is in cache."""
    numel = flat.numel()
    blocks = -(-numel // BLOCK)
    head = blocks * SCALE_BYTES
    code_bytes = numel if levels == 127 else -(-numel // 2)
    message = torch.empty(head + code_bytes, dtype=torch.uint8, device=flat.device)
    scales, codes = message[:head].view(torch.float32), message[head:]
    view = _blocks(flat, blocks)
    rows = max(1, min(CHUNK_BLOCKS, blocks))  # an empty tensor: no chunk
    work = torch.empty(rows, BLOCK, dtype=torch.float32, device=flat.device)
    signed = torch.empty(rows * BLOCK, dtype=torch.int8, device=flat.device) if levels == 7 else None
    per_block = BLOCK if levels == 127 else BLOCK // 2  # code bytes of a block
    for first in range(0, blocks, rows):
        v = view[first: first + rows]
        w = work[: len(v)]
        absmax = torch.abs(v, out=w).amax(dim=1)
        torch.div(absmax, levels, out=scales[first: first + len(v)])
        inverse = torch.where(absmax > 0, levels / absmax, torch.zeros_like(absmax))
        q = torch.mul(v, inverse[:, None], out=w).round_().clamp_(-levels, levels).view(-1)
        lo, hi = first * per_block, min((first + len(v)) * per_block, code_bytes)
        if signed is None:
            codes[lo:hi].view(torch.int8).copy_(q[: hi - lo])
            continue
        # nibbles 1 … 15 (a padding element is 0: nibble 8), two to an int16, the first in its low byte
        pairs = signed[: q.numel()].copy_(q).view(torch.uint8).add_(8).view(torch.int16)
        codes[lo:hi].copy_(torch.bitwise_or(pairs, pairs >> 4)[: hi - lo])  # low byte: first | second << 4
    return message


def dequantise_blockwise(message: torch.Tensor, numel: int, levels: int) -> torch.Tensor:
    """The inverse of ``quantise_blockwise``: a 1-D float32 tensor of ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    scales = _scales(message, blocks)
    payload = message[blocks * SCALE_BYTES:]
    if levels == 7:
        pairs = payload.to(torch.int16)  # a byte's low nibble to the int16's low byte, its high one to the high
        out = _as_floats((pairs | pairs << 4).bitwise_and_(0x0F0F).view(torch.uint8), blocks, numel)
        out[:numel].sub_(8)
    else:
        out = _as_floats(payload.view(torch.int8), blocks, numel)
    return out.view(blocks, BLOCK).mul_(scales[:, None]).view(-1)[:numel]


def quantise_2bit(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as ``int2``: per block of ``BLOCK`` a float32 step α, then 2-bit codes q (four to a byte, the
    first element in the low bits) for the levels (2q − 3)·α ∈ {−3α, −α, α, 3α}. α is the one of
    ``INT2_SCALES`` × absmax with the least squared error in the block, each element rounded to its nearest
    level: ``|x − x̂| ≤ max(α, absmax − 3α) ≤ absmax / 2``.

    Each candidate's error is computed in place in one reused buffer, ``CHUNK_BLOCKS`` blocks at a time (as
    ``quantise_blockwise``): the same float operations, in the same order, as on the whole tensor, so the
    same sums and the same choice, ties to the first candidate. A block whose errors overflow (|x| beyond
    about 1e19) or hold a NaN has no candidate better than none: step 0, so it decodes to zeros (as it
    always did: the bytes are kept)."""
    numel = flat.numel()
    blocks = -(-numel // BLOCK)
    head = blocks * SCALE_BYTES
    message = torch.empty(head + -(-numel // 4), dtype=torch.uint8, device=flat.device)
    steps, codes = message[:head].view(torch.float32), message[head:]
    view = _blocks(flat, blocks)
    rows = max(1, min(CHUNK_BLOCKS, blocks))  # an empty tensor: no chunk
    work = torch.empty(rows, BLOCK, dtype=torch.float32, device=flat.device)
    indices = torch.empty(rows * BLOCK, dtype=torch.uint8, device=flat.device)
    tail = numel - (blocks - 1) * BLOCK  # elements in the last block; the rest is padding, not scored
    for first in range(0, blocks, rows):
        v = view[first: first + rows]
        w = work[: len(v)]
        last = first + len(v) == blocks
        absmax = torch.abs(v, out=w).amax(dim=1)
        best_err = torch.full_like(absmax, math.inf)
        step = torch.zeros_like(absmax)
        for fraction in INT2_SCALES:
            alpha = absmax * fraction
            _level_index_2bit(v, alpha, w).mul_(2).sub_(3).mul_(alpha[:, None]).sub_(v).square_()  # (L·α − x)²
            if last:
                w[-1, tail:].mul_(0)  # times 0, not set to 0: an overflowed square scores NaN, as it did
            err = w.sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            step = torch.where(better, alpha, step)
        steps[first: first + len(v)] = step
        q = indices[: w.numel()].copy_(_level_index_2bit(v, step, w).view(-1))  # codes 0 … 3
        if last:
            q[q.numel() - BLOCK + tail:] = 0  # padding codes are 0
        quads = q.view(torch.int32)  # four codes an int32, the first in its low byte
        lo, hi = first * BLOCK // 4, min((first + len(v)) * BLOCK // 4, codes.numel())
        codes[lo:hi].copy_((quads | quads >> 6 | quads >> 12 | quads >> 18)[: hi - lo])  # low byte: q0 | q1 << 2 | …
    return message


def _level_index_2bit(view: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Into ``out``: the index 0 … 3 of the nearest of the levels −3, −1, 1, 3 to each element over its block's
    step ``alpha`` (the level is 2·index − 3), as float32."""
    inverse = torch.where(alpha > 0, 1 / alpha, torch.zeros_like(alpha))
    return torch.mul(view, inverse[:, None], out=out).add_(3).div_(2).round_().clamp_(0, 3)


def dequantise_2bit(message: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of ``quantise_2bit``: a 1-D float32 tensor of ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    steps = _scales(message, blocks)
    quads = message[blocks * SCALE_BYTES:].to(torch.int32)  # a byte's four codes to the four bytes of an int32
    codes = (quads | quads << 6 | quads << 12 | quads << 18).bitwise_and_(0x03030303).view(torch.uint8)
    out = _as_floats(codes, blocks, numel)
    out[:numel].mul_(2).sub_(3)
    return out.view(blocks, BLOCK).mul_(steps[:, None]).view(-1)[:numel]


def encode_topk(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as ``topk``: per block of ``TOPK_BLOCK`` elements (the last may be shorter) the ``TOPK_KEEP``
    of largest magnitude (all of a shorter tail's, up to that many), as one float32 scale (their absmax /
    127), their int8 codes rounded to nearest and their uint8 positions in increasing order; the rest is
    dropped (error feedback keeps it). The message: every block's scale, then its codes, then positions."""
    numel = flat.numel()
    full, tail = divmod(numel, TOPK_BLOCK)
    parts = [_topk_blocks(flat[: full * TOPK_BLOCK].view(full, TOPK_BLOCK), TOPK_KEEP)]
    if tail:
        parts.append(_topk_blocks(flat[full * TOPK_BLOCK:].view(1, tail), min(tail, TOPK_KEEP)))
    return torch.cat([torch.cat(kind) for kind in zip(*parts, strict=True)])


def _topk_blocks(view: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scales, codes and positions (as bytes) of ``view``'s rows, ``keep`` entries each."""
    positions = view.abs().topk(keep, dim=1, sorted=False).indices.sort(dim=1).values
    values = view.gather(1, positions)
    absmax = values.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, 127 / absmax, torch.zeros_like(absmax))
    codes = (values * inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    positions = positions.to(torch.uint8).reshape(-1)
    return (absmax / 127).view(torch.uint8), codes.reshape(-1).view(torch.uint8), positions


def decode_topk(message: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of ``encode_topk``: a 1-D float32 tensor of ``numel`` elements, 0 where none was sent."""
    full, tail = divmod(numel, TOPK_BLOCK)
    rows = [(full, TOPK_BLOCK, TOPK_KEEP)] + ([(1, tail, min(tail, TOPK_KEEP))] if tail else [])
    scales = _scales(message, full + (1 if tail else 0))
    kept = sum(count * keep for count, _, keep in rows)
    codes = message[scales.numel() * SCALE_BYTES:][:kept].view(torch.int8).to(torch.float32)
    positions = message[scales.numel() * SCALE_BYTES + kept:].to(torch.int64)
    out, first_block, first_kept = [], 0, 0
    for count, length, keep in rows:
        where = positions[first_kept: first_kept + count * keep].view(count, keep)
        if bool((where >= length).any()) or bool((where[:, 1:] <= where[:, :-1]).any()):
            raise WireError("topk message with a position out of its block or out of order")
        values = codes[first_kept: first_kept + count * keep].view(count, keep)
        values = values * scales[first_block: first_block + count, None]
        row = torch.zeros(count, length, dtype=torch.float32, device=message.device)
        out.append(row.scatter_(1, where, values).reshape(-1))
        first_block, first_kept = first_block + count, first_kept + count * keep
    return torch.cat(out)


def encode_lowrank(matrix: torch.Tensor) -> torch.Tensor:
    """A [rows, d] ``matrix`` as ``lowrank``: float32 factors Q [rows, r] (orthonormal columns) and
    B = Qᵀ·matrix [r, d], r = ``lowrank_rank(d)``; Q spans the range of matrix · Ω, Ω a [d, r] Gaussian drawn
    from a fixed seed, after ``_POWER_STEPS`` steps of power iteration (randomised SVD, Halko et al. 2011):
    exact, float32 rounding aside, when the matrix has rank r or less."""
    rows, d = matrix.shape
    r = lowrank_rank(d)
    omega = torch.randn(d, r, generator=torch.Generator().manual_seed(0)).to(matrix.device)
    q = torch.linalg.qr(matrix @ omega).Q
    for _ in range(_POWER_STEPS):
        q = torch.linalg.qr(matrix @ (matrix.T @ q)).Q
    if q.shape[1] < r:  # fewer rows than the rank
        q = torch.cat([q, q.new_zeros(rows, r - q.shape[1])], dim=1)
    factors = torch.cat([q.reshape(-1), (q.T @ matrix).reshape(-1)])
    return factors.contiguous().view(torch.uint8)


def decode_lowrank(message: torch.Tensor, rows: int, d: int) -> torch.Tensor:
    """The inverse of ``encode_lowrank``: the [rows, d] product of the factors."""
    r = lowrank_rank(d)
    factors = message.clone().view(torch.float32)
    if not bool(torch.isfinite(factors).all()):
        raise WireError("lowrank message with a non-finite factor")
    return factors[: rows * r].view(rows, r) @ factors[rows * r:].view(r, d)


def _scales(message: torch.Tensor, blocks: int) -> torch.Tensor:
    """The first ``blocks`` float32 scales of ``message``; WireError if one is negative or not finite."""
    scales = message[: blocks * SCALE_BYTES].clone().view(torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError("quantised message with a negative or non-finite scale")
    return scales


def _blocks(flat: torch.Tensor, blocks: int) -> torch.Tensor:
    """``flat`` as ``[blocks, BLOCK]``, zero-padded at the end when its size is not a multiple of BLOCK."""
    if flat.numel() == blocks * BLOCK:
        return flat.view(blocks, BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(blocks, BLOCK)


def _as_floats(codes: torch.Tensor, blocks: int, numel: int) -> torch.Tensor:
    """The first ``numel`` of ``codes`` as float32, in a buffer of ``blocks`` × ``BLOCK`` (its padding 0)."""
    if numel == blocks * BLOCK:
        return codes[:numel].to(torch.float32)
    out = torch.empty(blocks * BLOCK, dtype=torch.float32, device=codes.device)
    out[numel:] = 0
    out[:numel].copy_(codes[:numel])
    return out


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
        if residual is None or residual.shape != x.shape:
            corrected = x  # the caller's: read, never written
        elif residual.dtype == torch.result_type(x, residual) and residual.device == x.device:
            corrected = residual.add_(x)  # x + residual, in the residual's own memory (the sum is the same)
        else:
            corrected = x + residual
        message = self.codec.encode(corrected)  # neither the message nor the decoded value shares its memory
        decoded = self.codec.decode(message, tuple(x.shape))
        self.residuals[key] = corrected.sub_(decoded) if corrected is not x else corrected - decoded
        return message, decoded
