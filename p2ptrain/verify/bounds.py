"""What a message tells its receiver about the value its sender encoded: each codec's element-wise error bound.

For a message ``M`` of codec ``c`` carrying a float32 tensor ``x`` (``x̂ = c.decode(M)``),
``error_bound(c, M, shape)`` is a float64 tensor ``β`` of ``x``'s shape with ``|x_j − x̂_j| ≤ β_j`` for every
``x`` that ``c.encode`` turns into ``M`` (``p2ptrain.runtime.wire``; the bounds ``tests/runtime/test_wire.py``
and ``test_wire_codecs.py`` test on the encoder's side):

* ``fp32``: 0, exact;
* ``bf16``: round to nearest with 8 significant bits, so half a unit in the last place of ``x̂``:
  ``|x − x̂| ≤ 2^-8 |x̂|`` (plus 2^-133 below bfloat16's normal range);
* ``int8``, ``int4`` (levels L = 127, 7): the block's scale ``s = absmax / L`` is in the message and codes are
  rounded to nearest: ``|x − x̂| ≤ s / 2``;
* ``int2``: the block's step α is in the message; an element decoded to ±α lay within α of it, one decoded
  to ±3α within ``max(α, absmax − 3α) ≤ 3α``, since α ≥ absmax / 6 (``INT2_SCALES``);
* ``topk`` and ``lowrank``: a dropped element (or component) may be anything: no bound, refused.

Float32 rounding inside ``encode`` and ``decode`` (the product ``x · L / absmax``, the scale ``absmax / L``,
the product ``code · s``) moves ``x̂`` by a few units in float32's last place (2^-24) of ``|x̂|`` and ``s``; the
bounds add ``2^-16 (|x̂| + s)``, far more than those few roundings need.

A block whose scale is positive holds, from an honest encoder, at least one code at the extreme level (±L,
or ±3α for ``int2``): its largest element. A message without one is refused (``ValueError``): otherwise a
sender could pick a huge scale with small codes and so give itself a huge bound, and zero a block unseen.
Non-finite decoded values are refused too.
"""

from __future__ import annotations

import math

import torch

from p2ptrain.runtime.wire import BLOCK, SCALE_BYTES, Codec

ROUNDING_SLACK = 2.0**-16  # relative allowance for float32 rounding inside encode/decode (see the module)
_BF16_UNIT = 2.0**-8
_BF16_TINY = 2.0**-133
_LEVELS = {"int8": 127, "int4": 7}


def error_bound(codec: Codec, message: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``β``, float64 of ``shape``: ``|x − decode(message)| ≤ β`` element-wise for any ``x`` encoded to ``message``.

    ValueError (one line) for a codec without an element-wise bound, a message that does not decode, a block
    no honest encoder makes, or non-finite values."""
    if codec.name in ("topk", "lowrank"):
        raise ValueError(f"codec {codec.name} has no element-wise error bound (a dropped value may be anything)")
    try:
        decoded = codec.decode(message, tuple(shape))
    except ValueError as error:  # WireError is a ValueError; keep it one line
        raise ValueError(f"message does not decode: {error}") from None
    if codec.name in ("fp32", "bf16"):
        if not all_finite(decoded):
            raise ValueError(f"{codec.name} message holds non-finite values")
        if codec.name == "fp32":  # exact: one zero seen at every index (read-only; nothing allocated per element)
            return torch.zeros((), dtype=torch.float64).expand(tuple(shape))
        return decoded.to(torch.float64).abs_().mul_(_BF16_UNIT + ROUNDING_SLACK).add_(_BF16_TINY)
    numel = math.prod(shape)
    blocks = -(-numel // BLOCK)
    scales = message[: blocks * SCALE_BYTES].clone().view(torch.float32)  # finite and ≥ 0: decode checked
    extreme = 3 if codec.name == "int2" else _LEVELS[codec.name]
    if not bool(torch.isfinite(scales * extreme).all()):
        raise ValueError(f"{codec.name} message with a scale too large to decode")
    magnitude = torch.zeros(blocks * BLOCK, dtype=torch.float64)
    magnitude[:numel] = decoded.reshape(-1)
    magnitude = magnitude.abs_().view(blocks, BLOCK)
    scale = scales.to(torch.float64)[:, None]
    levels = torch.where(scale > 0, magnitude / torch.where(scale > 0, scale, 1.0), 0.0).round_()  # |code|
    bad = (scales > 0) & (levels.amax(dim=1) < extreme)
    if bool(bad.any()):
        raise ValueError(f"{codec.name} message: block {int(bad.nonzero()[0, 0])} has a positive scale and no code "
                         f"at ±{extreme}, which no honest encoder makes")
    if codec.name == "int2":
        half_width = torch.where(levels > 2, 3.0, 1.0) * scale
    else:
        half_width = scale.expand(blocks, BLOCK) / 2
    bound = half_width + ROUNDING_SLACK * (magnitude + scale)
    return bound.reshape(-1)[:numel].reshape(tuple(shape))


def all_finite(x: torch.Tensor) -> bool:
    """Whether float tensor ``x`` holds no NaN and no infinity: its smallest and largest value are finite (NaN
    propagates through both). One pass, no mask (``torch.isfinite(x).all()`` took 17 ns an element on a CPU,
    more than the sketch of it)."""
    if x.numel() == 0 or not x.dtype.is_floating_point:
        return True
    low, high = torch.aminmax(x.detach())
    return math.isfinite(float(low)) and math.isfinite(float(high))
