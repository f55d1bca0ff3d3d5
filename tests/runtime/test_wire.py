"""Wire codecs: exact sizes, round-trip error bounds, malformed messages refused in one line."""

import hashlib
import math

import pytest
import torch

from p2ptrain.runtime.wire import (
    BLOCK,
    CODECS,
    WIRE_FORMATS,
    Codec,
    ErrorFeedback,
    WireError,
    bytes_per_element,
    wire_bytes,
    wire_format,
)

SHAPES = [(1,), (63,), (64,), (65,), (3, 5, 7), (2, 129)]


def sample(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, math.prod(shape)).reshape(shape)
    return x


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", [c for c in CODECS if c != "lowrank"])
def test_message_sizes_are_exact(name, shape):
    codec = Codec(name)
    message = codec.encode(sample(shape))
    want_shape, want_dtype = codec.wire_spec(shape)
    assert tuple(message.shape) == want_shape and message.dtype == want_dtype
    nbytes = message.numel() * message.element_size()
    assert nbytes == wire_bytes(name, math.prod(shape))
    if math.prod(shape) % (4 * BLOCK) == 0:  # whole blocks (topk's are 256 elements)
        assert nbytes == bytes_per_element(name) * math.prod(shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_bounds(shape):
    x = sample(shape)
    assert torch.equal(Codec("fp32").round_trip(x), x)  # exact, bit for bit
    bf16 = Codec("bf16").round_trip(x)
    assert ((bf16 - x).abs() <= x.abs() * 2**-8).all()
    flat = x.reshape(-1)
    blocks = -(-flat.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK)
    padded[: flat.numel()] = flat.abs()
    absmax = padded.view(blocks, BLOCK).amax(1).repeat_interleave(BLOCK)[: flat.numel()]
    for name, levels in (("int8", 127), ("int4", 7)):
        got = Codec(name).round_trip(x).reshape(-1)
        bound = absmax / (2 * levels) * (1 + 1e-5)
        assert ((got - flat).abs() <= bound).all(), name


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_zeros_and_extremes_survive(name):
    codec = Codec(name)
    x = torch.zeros(130)
    assert torch.equal(codec.round_trip(x), x)
    x[5], x[70] = -3.0, 1e30
    got = codec.round_trip(x)
    assert got[5] == -3.0 and got[70] == pytest.approx(1e30, rel=1e-6)


def test_malformed_messages_are_refused_in_one_line():
    codec = Codec("int8")
    message = codec.encode(torch.randn(100))
    with pytest.raises(WireError) as info:
        codec.decode(message[:-1], (100,))
    assert "\n" not in str(info.value)
    bad = message.clone()
    bad[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(WireError, match="scale"):
        codec.decode(bad, (100,))
    with pytest.raises(WireError):
        Codec("bf16").decode(torch.zeros(100), (100,))  # float32 where bfloat16 was announced
    with pytest.raises(ValueError, match="unknown wire format 'int3'"):
        wire_format("int3")


@pytest.mark.parametrize(("name", "digest"), [("bf16", "99970ecd22cd0edb"), ("int8", "1be5cd194b034aa1"),
                                             ("int4", "4814c13af4635298")])
def test_the_first_formats_messages_keep_their_bytes(name, digest):
    """Captured before the codecs below int4 were added: a peer of an older version decodes them alike."""
    message = Codec(name).encode(torch.linspace(-1.5, 2.0, 130) ** 3).view(torch.uint8)
    assert hashlib.sha256(message.numpy().tobytes()).hexdigest()[:16] == digest


@pytest.mark.parametrize("name", WIRE_FORMATS)
def test_each_wire_names_its_codec_per_kind(name):
    kinds = {"fp32": ("fp32",) * 3, "bf16": ("bf16",) * 3, "int8": ("int8",) * 3,
             "int4": ("int4", "int8", "int4"), "int4_all": ("int4",) * 3, "int2": ("int2", "int4", "int2")}
    from p2ptrain.net.dht.record_base import SETTINGS_RE

    assert SETTINGS_RE.fullmatch(f"wire={name}")  # a peer record states its run's wire
    fmt = wire_format(name)
    assert fmt.name == name
    assert (fmt.activation.name, fmt.activation_grad.name, fmt.gradient.name) == kinds[name]
    for codec in (fmt.activation, fmt.activation_grad, fmt.gradient):
        x = sample((3, 64))
        assert codec.round_trip(x).shape == x.shape


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_error_feedback_carries_what_was_dropped(name):
    """Sending the same small vector repeatedly: the decoded values' running sum follows the true one within
    one quantisation error, whereas plain rounding would lose the small entries every time."""
    feedback = ErrorFeedback(Codec(name))
    x = torch.full((64,), 1e-3)
    x[0] = 1.0  # the block's scale: 1e-3 rounds to 0 in int8 and int4
    sent = torch.zeros(64)
    for _ in range(50):
        _, decoded = feedback.encode("bucket", x)
        sent += decoded
    assert (sent - 50 * x).abs().max() <= 1.0 / 14 + 1e-6
    if name != "bf16":
        assert Codec(name).round_trip(x)[1] == 0  # what feedback recovers


def test_fp32_feedback_is_the_identity():
    feedback = ErrorFeedback(Codec("fp32"))
    x = torch.randn(10)
    message, decoded = feedback.encode(0, x)
    assert torch.equal(message, x) and torch.equal(decoded, x) and not feedback.residuals


def test_unknown_wire_or_schedule_in_a_config_is_one_line():
    from p2ptrain.config import config_from_dict
    from p2ptrain.errors import ConfigError
    from p2ptrain.runtime.config import TrainConfig

    for key, value in (("wire", "int3"), ("schedule", "pipedream"), ("bucket_elements", 0)):
        with pytest.raises(ConfigError) as info:
            config_from_dict(TrainConfig, {key: value})
        assert "\n" not in str(info.value) and str(value) in str(info.value)
    assert config_from_dict(TrainConfig, {"wire": "int8", "schedule": "1f1b", "overlap": False}).wire == "int8"
