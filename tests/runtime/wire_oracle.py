"""The wire codecs as they were before they were made cheaper (issue 31): the oracle that
``test_wire_identity.py`` holds today's messages to, byte for byte, and that ``benchmarks/codec_speed.py``
times today's codecs against. A frozen copy: do not "fix" it, it is the definition of the bytes."""

from __future__ import annotations

import math

import torch

BLOCK = 64
SCALE_BYTES = 4
LEVELS = {"int8": 127, "int4": 7}
INT2_SCALES = (1 / 6, 5 / 24, 1 / 4, 7 / 24, 1 / 3)
QUANTISED = ("int8", "int4", "int2")


def encode(name: str, x: torch.Tensor) -> torch.Tensor:
    """``Codec(name).encode(x)`` as it was, for the codecs made cheaper (fp32, bf16, int8, int4, int2)."""
    x = x.detach().to(torch.float32)
    if name == "fp32":
        return x.to("cpu").contiguous()
    if name == "bf16":
        return x.to(torch.bfloat16).to("cpu").contiguous()
    flat = x.contiguous().reshape(-1)
    if name == "int2":
        return quantise_2bit(flat).to("cpu")
    return quantise_blockwise(flat, LEVELS[name]).to("cpu")


def decode(name: str, message: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``Codec(name).decode(message, shape)`` as it was."""
    want_shape, want_dtype = _wire_spec(name, shape)
    if tuple(message.shape) != want_shape or message.dtype != want_dtype:
        raise ValueError(f"{name} message of {tuple(message.shape)} {message.dtype}, expected {want_shape} {want_dtype}")
    if name == "fp32":
        return message
    if name == "bf16":
        return message.to(torch.float32)
    numel = math.prod(shape)
    if name == "int2":
        return dequantise_2bit(message, numel).reshape(shape)
    return dequantise_blockwise(message, numel, LEVELS[name]).reshape(shape)


def _wire_spec(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    if name == "fp32":
        return tuple(shape), torch.float32
    if name == "bf16":
        return tuple(shape), torch.bfloat16
    numel = math.prod(shape)
    codes = {"int8": numel, "int4": -(-numel // 2), "int2": -(-numel // 4)}[name]
    return (-(-numel // BLOCK) * SCALE_BYTES + codes,), torch.uint8


class ErrorFeedback:
    """``wire.ErrorFeedback`` as it was, over this module's codecs."""

    def __init__(self, name: str):
        self.name = name
        self.residuals: dict[object, torch.Tensor] = {}

    def encode(self, key: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "fp32":
            return encode(self.name, x), x
        residual = self.residuals.get(key)
        corrected = x if residual is None or residual.shape != x.shape else x + residual
        message = encode(self.name, corrected)
        decoded = decode(self.name, message, tuple(x.shape))
        self.residuals[key] = corrected - decoded
        return message, decoded


def quantise_blockwise(flat: torch.Tensor, levels: int) -> torch.Tensor:
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
    blocks = -(-numel // BLOCK)
    scales = _scales(message, blocks)
    payload = message[blocks * SCALE_BYTES:]
    if levels == 7:
        codes = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1)[:numel].to(torch.float32) - 8
    else:
        codes = payload.view(torch.int8).to(torch.float32)
    return (_blocks(codes, blocks) * scales[:, None]).reshape(-1)[:numel]


def quantise_2bit(flat: torch.Tensor) -> torch.Tensor:
    numel = flat.numel()
    blocks = -(-numel // BLOCK)
    view = _blocks(flat, blocks)
    absmax = view.abs().amax(dim=1)
    best_err = torch.full_like(absmax, math.inf)
    step = torch.zeros_like(absmax)
    padding = torch.arange(blocks * BLOCK, device=flat.device).view(blocks, BLOCK) < numel  # not scored
    for fraction in INT2_SCALES:
        alpha = absmax * fraction
        err = (_levels_2bit(view, alpha) * alpha[:, None] - view).square_().mul_(padding).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        step = torch.where(better, alpha, step)
    codes = ((_levels_2bit(view, step) + 3) / 2).to(torch.uint8).reshape(-1)[:numel]
    codes = torch.cat([codes, codes.new_zeros(-numel % 4)]).view(-1, 4)
    packed = codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6
    return torch.cat([step.view(torch.uint8), packed])


def _levels_2bit(view: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    inverse = torch.where(alpha > 0, 1 / alpha, torch.zeros_like(alpha))
    return ((view * inverse[:, None] + 3) / 2).round_().clamp_(0, 3).mul_(2).sub_(3)


def dequantise_2bit(message: torch.Tensor, numel: int) -> torch.Tensor:
    blocks = -(-numel // BLOCK)
    steps = _scales(message, blocks)
    payload = message[blocks * SCALE_BYTES:]
    codes = torch.stack([payload & 3, payload >> 2 & 3, payload >> 4 & 3, payload >> 6], dim=1).reshape(-1)
    levels = codes[:numel].to(torch.float32).mul_(2).sub_(3)
    return (_blocks(levels, blocks) * steps[:, None]).reshape(-1)[:numel]


def _scales(message: torch.Tensor, blocks: int) -> torch.Tensor:
    scales = message[: blocks * SCALE_BYTES].clone().view(torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("quantised message with a negative or non-finite scale")
    return scales


def _blocks(flat: torch.Tensor, blocks: int) -> torch.Tensor:
    if flat.numel() == blocks * BLOCK:
        return flat.view(blocks, BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(blocks, BLOCK)
