"""The codecs below int4 (``int2``, ``topk``, ``lowrank``): their derived error bounds, exact sizes, refusal
of malformed messages, and error feedback recovering what ``topk`` and ``int2`` drop."""

import math

import pytest
import torch

from p2ptrain.runtime.wire import (
    BLOCK,
    CODECS,
    INT2_SCALES,
    SCALE_BYTES,
    TOPK_BLOCK,
    TOPK_KEEP,
    Codec,
    ErrorFeedback,
    WireError,
    bytes_per_element,
    lowrank_bytes,
    lowrank_rank,
    message_bytes,
    wire_bytes,
)

SHAPES = [(1,), (7,), (63,), (64,), (65,), (255,), (256,), (300,), (3, 5, 64), (2, 129), (4, 256)]


def sample(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.logspace(-3, 2, math.prod(shape)).reshape(shape)


def block_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's absmax."""
    blocks = -(-flat.numel() // block)
    padded = torch.zeros(blocks * block)
    padded[: flat.numel()] = flat.abs()
    return padded.view(blocks, block).amax(1).repeat_interleave(block)[: flat.numel()]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CODECS)
def test_every_codec_message_has_its_announced_size(name, shape):
    codec = Codec(name)
    message = codec.encode(sample(shape))
    want_shape, want_dtype = codec.wire_spec(shape)
    assert tuple(message.shape) == want_shape and message.dtype == want_dtype
    nbytes = message.numel() * message.element_size()
    assert nbytes == message_bytes(name, shape)
    if len(shape) == 1:
        assert nbytes == wire_bytes(name, shape[0])
    if name == "lowrank":
        assert nbytes == lowrank_bytes(math.prod(shape[:-1]), shape[-1])
    elif math.prod(shape) % TOPK_BLOCK == 0:
        assert nbytes == bytes_per_element(name) * math.prod(shape)


def test_sizes_per_element_below_int4():
    assert bytes_per_element("int2") == 0.25 + SCALE_BYTES / BLOCK == 0.3125
    assert bytes_per_element("topk") == (SCALE_BYTES + 2 * TOPK_KEEP) / TOPK_BLOCK == 0.078125
    assert lowrank_rank(64) == 4 and lowrank_bytes(256, 64) == 4 * 4 * (256 + 64)
    with pytest.raises(ValueError, match="lowrank"):
        bytes_per_element("lowrank")


@pytest.mark.parametrize("shape", SHAPES)
def test_int2_error_is_within_its_chosen_step(shape):
    """|x − x̂| ≤ max(α, absmax − 3α) for the block's step α, one of INT2_SCALES × absmax; so ≤ absmax / 2."""
    x = sample(shape).reshape(-1)
    message = Codec("int2").encode(x)
    blocks = -(-x.numel() // BLOCK)
    alpha = message[: blocks * SCALE_BYTES].clone().view(torch.float32).repeat_interleave(BLOCK)[: x.numel()]
    absmax = block_absmax(x, BLOCK)
    fractions = torch.tensor(INT2_SCALES)
    ratio = alpha[absmax > 0] / absmax[absmax > 0]
    assert ((ratio[:, None] - fractions).abs().amin(1) <= 1e-6).all()
    err = (Codec("int2").decode(message, (x.numel(),)) - x).abs()
    assert (err <= torch.maximum(alpha, absmax - 3 * alpha) * (1 + 1e-5) + 1e-30).all()
    assert (err <= absmax / 2 * (1 + 1e-5)).all()


def test_int2_picks_the_step_with_the_least_error():
    """A block whose values sit on the levels of α = absmax / 3 decodes exactly; a Gaussian block loses no more
    than with the fixed step absmax / 4 (near Lloyd–Max's optimum for four levels: 0.34 relative error)."""
    on_levels = torch.tensor([-3.0, -1.0, 1.0, 3.0] * 16) * 0.5
    assert torch.equal(Codec("int2").round_trip(on_levels), on_levels)
    x = torch.randn(64 * 100, generator=torch.Generator().manual_seed(1))
    got = Codec("int2").round_trip(x)
    view = x.view(-1, BLOCK)
    alpha = view.abs().amax(1, keepdim=True) / 4
    fixed = ((view / alpha + 3) / 2).round().clamp(0, 3).mul(2).sub(3) * alpha
    assert (got - x).norm() <= (fixed.reshape(-1) - x).norm()
    assert float((got - x).norm() / x.norm()) < 0.36


@pytest.mark.parametrize("shape", SHAPES)
def test_topk_keeps_the_largest_within_int8_error_and_drops_the_rest_exactly(shape):
    x = sample(shape).reshape(-1)
    got = Codec("topk").round_trip(x)
    for start in range(0, x.numel(), TOPK_BLOCK):
        block, sent = x[start: start + TOPK_BLOCK], got[start: start + TOPK_BLOCK]
        keep = min(TOPK_KEEP, block.numel())
        kept = block.abs().topk(keep).indices
        dropped = torch.ones(block.numel(), dtype=torch.bool)
        dropped[kept] = False
        assert (sent[dropped] == 0).all()  # what error feedback keeps is exactly the dropped value
        bound = block.abs().max() / 254 * (1 + 1e-5)
        assert ((sent[kept] - block[kept]).abs() <= bound).all()


def test_lowrank_is_exact_on_a_low_rank_matrix_and_deterministic():
    gen = torch.Generator().manual_seed(2)
    rows, d = 96, 64
    r = lowrank_rank(d)
    x = (torch.randn(rows, r, generator=gen) @ torch.randn(r, d, generator=gen)).reshape(2, 48, d)
    codec = Codec("lowrank")
    assert torch.equal(codec.encode(x), codec.encode(x.clone()))
    assert torch.allclose(codec.round_trip(x), x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_lowrank_error_is_near_the_best_rank_r_error():
    """On a matrix with a decaying spectrum, within 5 % of the truncated SVD's error (Eckart–Young)."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(128, 64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen))
    x = u @ torch.diag(0.5 ** torch.arange(64.0)) @ v.T
    best = float(torch.linalg.svdvals(x)[lowrank_rank(64):].square().sum().sqrt())
    assert float((Codec("lowrank").round_trip(x) - x).norm()) <= 1.05 * best


def _message_with(codec: Codec, x: torch.Tensor, at: int, value: torch.Tensor) -> torch.Tensor:
    message = codec.encode(x).clone()
    message[at: at + value.numel()] = value
    return message


@pytest.mark.parametrize("name", ["int2", "topk", "lowrank"])
def test_malformed_messages_are_refused_in_one_line(name):
    codec = Codec(name)
    x = torch.randn(5, 64)
    message = codec.encode(x)
    with pytest.raises(WireError) as info:
        codec.decode(message[:-1], (5, 64))
    assert "\n" not in str(info.value)
    for bad in (float("nan"), float("inf"), -1.0):
        corrupt = _message_with(codec, x, 0, torch.tensor([bad]).view(torch.uint8))
        if name == "lowrank" and bad == -1.0:
            continue  # a factor may be negative
        with pytest.raises(WireError, match="scale|factor"):
            codec.decode(corrupt, (5, 64))


def test_topk_positions_out_of_their_block_or_order_are_refused():
    codec = Codec("topk")
    numel = TOPK_BLOCK + 20  # a full block and a tail of 20
    message = codec.encode(torch.randn(numel))
    positions_at = 2 * SCALE_BYTES + 2 * TOPK_KEEP
    assert torch.equal(codec.decode(message, (numel,)), codec.decode(message.clone(), (numel,)))
    tail_last = message.clone()
    tail_last[-1] = 20  # past the tail's 20 elements
    duplicate = message.clone()
    duplicate[positions_at + 1] = duplicate[positions_at]
    backwards = message.clone()
    backwards[positions_at: positions_at + TOPK_KEEP] = message[positions_at: positions_at + TOPK_KEEP].flip(0)
    for corrupt in (tail_last, duplicate, backwards):
        with pytest.raises(WireError, match="position"):
            codec.decode(corrupt, (numel,))


@pytest.mark.parametrize("name", ["int2", "topk"])
def test_error_feedback_makes_the_decoded_sum_track_the_inputs(name):
    """Random gradients, 300 steps: the sum of what was sent follows the sum of the inputs within the last
    residual (sent + residual = inputs, exactly up to float rounding), and that residual stays small next to
    the sum, where without feedback the error of the sum grows with the steps."""
    gen = torch.Generator().manual_seed(4)
    feedback = ErrorFeedback(Codec(name))
    bias = torch.randn(1024, generator=gen) * 0.1
    total, sent, plain = torch.zeros(1024), torch.zeros(1024), torch.zeros(1024)
    for _ in range(300):
        x = bias + torch.randn(1024, generator=gen)
        _, decoded = feedback.encode("bucket", x)
        total += x
        sent += decoded
        plain += Codec(name).round_trip(x)
    assert torch.allclose(sent + feedback.residuals["bucket"], total, atol=1e-3)
    assert float((sent - total).norm() / total.norm()) < 0.25 * float((plain - total).norm() / total.norm())
    assert float((sent - total).norm() / total.norm()) < 0.3
