"""The cheaper codecs (issue 31) send today's bytes: every message, decoded value and error-feedback residual
equal, bit for bit, those of the codecs as they were (``wire_oracle``, a frozen copy), on random inputs and on
adversarial ones: ties at rounding midpoints, zeros and −0, subnormals, values near the float32 limit, NaN and
±inf, sizes around a block and around a chunk, one and two threads."""

from __future__ import annotations

import pytest
import torch
import wire_oracle as oracle

from p2ptrain.runtime.wire import BLOCK, CHUNK_BLOCKS, INT2_SCALES, SCALE_BYTES, Codec, ErrorFeedback

NAMES = ("fp32", "bf16", "int8", "int4", "int2")
SIZES = (0, 1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 130, 1000, 4099, CHUNK_BLOCKS * BLOCK, 2 * CHUNK_BLOCKS * BLOCK + 67)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def adversarial_block_values() -> list[torch.Tensor]:
    """Blocks (of ``BLOCK``) that stress rounding, ties and the ends of the float32 range."""
    absmax = 1.7
    ramp = torch.arange(BLOCK, dtype=torch.float32) - BLOCK / 2
    blocks = [
        torch.zeros(BLOCK), torch.full((BLOCK,), -0.0), torch.full((BLOCK,), 0.5), ramp,
        torch.tensor([-3.0, -1.0, 1.0, 3.0] * (BLOCK // 4)) * 0.25,  # on int2's levels of α = absmax / 3
        torch.full((BLOCK,), 1e-42), torch.full((BLOCK,), -3.4e38), torch.full((BLOCK,), 3e38),
        torch.full((BLOCK,), 2e19), torch.logspace(-40, 38, BLOCK) * torch.tensor([1.0, -1.0] * (BLOCK // 2)),
        torch.tensor([absmax] + [0.0] * (BLOCK - 1)),  # one element carries the block
    ]
    for levels in (127, 7):  # codes exactly at the midpoints k + 1/2 (round half to even decides)
        midpoints = (torch.arange(BLOCK - 1, dtype=torch.float32) % levels + 0.5) * (absmax / levels)
        blocks.append(torch.cat([torch.tensor([absmax]), midpoints * torch.tensor([1.0, -1.0]).repeat(BLOCK)[:BLOCK - 1]]))
    for fraction in INT2_SCALES:  # int2: elements at the boundaries between levels, for every candidate step
        alpha = absmax * fraction
        edges = torch.tensor([-2.0, 0.0, 2.0]).repeat(BLOCK)[: BLOCK - 1] * alpha
        blocks.append(torch.cat([torch.tensor([absmax]), edges]))
    special = torch.randn(BLOCK, generator=torch.Generator().manual_seed(3))
    special[[3, 17, 40]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    blocks += [special, torch.where(torch.arange(BLOCK) == 9, float("nan"), 0.0)]
    return blocks


def inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(n, generator=gen) * torch.logspace(-3, 3, n) for n in SIZES]
    out.append(torch.randn(7, 9, BLOCK, generator=gen))  # a shape, not a vector
    blocks = adversarial_block_values()
    out.append(torch.cat(blocks))
    out += [b[:k] for b in blocks for k in (5, BLOCK - 1)]  # each alone, padded
    tied = torch.cat(blocks * (CHUNK_BLOCKS // len(blocks) + 2))  # across a chunk's edge
    out += [tied, tied[: CHUNK_BLOCKS * BLOCK + 33]]
    return out


INPUTS = inputs()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN's bits included), shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True


@pytest.mark.parametrize("name", NAMES)
def test_messages_and_decoded_values_are_the_old_ones_bit_for_bit(name, threads):
    codec = Codec(name)
    for x in INPUTS:
        message, want = codec.encode(x), oracle.encode(name, x)
        assert same(message, want), f"{name}: {x.numel()} elements encode differently"
        blocks = -(-x.numel() // BLOCK)
        if name in oracle.QUANTISED and not torch.isfinite(want[: blocks * SCALE_BYTES].view(torch.float32)).all():
            continue  # a non-finite scale: refused by both (test_wire_codecs)
        assert same(codec.decode(message, tuple(x.shape)), oracle.decode(name, want, tuple(x.shape)))


@pytest.mark.parametrize("name", oracle.QUANTISED)
def test_any_valid_message_decodes_to_the_old_values(name, threads):
    """Random payload bytes under random finite scales: every code of every position decodes as it did."""
    gen = torch.Generator().manual_seed(1)
    for numel in (1, 3, 5, 64, 65, 127, 1001, CHUNK_BLOCKS * BLOCK + 7):
        shape = (numel,)
        size, _ = Codec(name).wire_spec(shape)
        message = torch.randint(0, 256, size, dtype=torch.uint8, generator=gen)
        blocks = -(-numel // BLOCK)
        scales = torch.rand(blocks, generator=gen) * torch.logspace(-38, 37, blocks)
        scales[::7] = 0.0
        message[: blocks * SCALE_BYTES] = scales.view(torch.uint8)
        assert same(Codec(name).decode(message, shape), oracle.decode(name, message, shape))


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_sends_and_keeps_what_it_did(name, threads):
    """Five steps of three keys (one changes its size midway): the same messages, decoded values and residuals
    as before, and the caller's tensor untouched."""
    gen = torch.Generator().manual_seed(2)
    new, old = ErrorFeedback(Codec(name)), oracle.ErrorFeedback(name)
    for step in range(5):
        for key, n in (("a", 1000), ("b", 64 * 33), ("c", 130 if step < 3 else 200)):
            x = torch.randn(n, generator=gen) * 10.0 ** float(step - 2)
            before = x.clone()
            message, decoded = new.encode(key, x)
            want_message, want_decoded = old.encode(key, x)
            assert same(x, before), "error feedback wrote into the caller's tensor"
            assert same(message, want_message) and same(decoded, want_decoded)
            if name != "fp32":
                assert same(new.residuals[key], old.residuals[key])
