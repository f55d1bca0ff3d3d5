"""Commit first, reveal what is checked after: message digests, and the challenge that picks what is checked.

A member publishes the digest of every tensor message it sends in a step (``message_digest``: BLAKE3 of a
domain tag, the message's tag, dtype and shape, then its bytes, little-endian as every supported platform
stores them) before the step's challenge exists. The challenge seed is a hash of all those digests
(``sketch.challenge_seed``), so it is fixed only after the last message is committed; from it, ``Challenge``
picks which micro-batches of each member are recomputed. A member cannot compute honestly only where it is
watched: when it computes, it cannot know where that will be. Whoever is later shown a message (a verifier,
or anyone settling a blame) checks it against the digest with ``matches_digest``.

How often: each member's micro-batches are checked at ``rate`` per step (``DEFAULT_RATE``, 1 in 8): with
``M`` micro-batches, ``⌊M·rate⌋`` of them and one more with probability ``frac(M·rate)``, a subset drawn
uniformly. ``survival_probability`` is the chance that a member corrupting ``corrupted`` of its micro-batches
every step is never caught in ``k`` steps.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from dataclasses import dataclass

import torch
from blake3 import blake3

DEFAULT_RATE = 1 / 8  # micro-batches checked per member per step
_DOMAIN = b"p2ptrain.verify.message\0"


def message_digest(message: torch.Tensor, tag: str) -> bytes:
    """BLAKE3 (32 bytes) of ``message`` under ``tag`` (e.g. ``"activation/run/epoch/step/micro_batch/part/
    sender/receiver"``: whatever names the message uniquely), its dtype and shape included."""
    if not isinstance(message, torch.Tensor):
        raise ValueError(f"a message is a tensor, got {type(message).__name__}")
    if not isinstance(tag, str) or not tag:
        raise ValueError("a message digest needs a non-empty tag naming the message")
    flat = message.detach().to("cpu").contiguous().reshape(-1)
    h = blake3(_DOMAIN)  # 4.6 GB/s on one core here, SHA-256 1.2: a step's digests were a third of the sum check
    header = f"{tag}\0{str(message.dtype).removeprefix('torch.')}\0{','.join(map(str, message.shape))}\0"
    h.update(struct.pack("<I", len(header)) + header.encode())
    h.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")  # the tensor's own bytes, not a copy
    return h.digest()


def matches_digest(message: torch.Tensor, tag: str, digest: bytes) -> bool:
    """Whether a revealed ``message`` is the one committed as ``digest`` under ``tag``."""
    if not isinstance(digest, bytes | bytearray) or len(digest) != 32:
        raise ValueError(f"a digest is 32 bytes, got {len(digest) if isinstance(digest, bytes | bytearray) else digest!r}")
    return hmac.compare_digest(message_digest(message, tag), bytes(digest))


@dataclass(frozen=True)
class Challenge:
    """Which micro-batches of a step are recomputed, from the step's challenge seed and the run's rate."""

    seed: int
    rate: float = DEFAULT_RATE

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"a challenge seed is an integer in [0, 2^64), got {self.seed!r}")
        if not (isinstance(self.rate, int | float) and 0 <= self.rate <= 1):
            raise ValueError(f"a challenge rate lies in [0, 1], got {self.rate!r}")

    def micro_batches(self, stage: int, replica: int, num_micro_batches: int) -> tuple[int, ...]:
        """The micro-batches (sorted) of the member holding (``stage``, ``replica``) checked this step."""
        if num_micro_batches < 1 or stage < 0 or replica < 0:
            raise ValueError(f"no micro-batches to pick from ({num_micro_batches} at stage {stage}, "
                             f"replica {replica})")
        expected = num_micro_batches * self.rate
        count = math.floor(expected)
        if self._uniform(stage, replica, "count") < expected - count:
            count += 1
        order = sorted(range(num_micro_batches), key=lambda m: self._uniform(stage, replica, "micro", m))
        return tuple(sorted(order[:count]))

    def _uniform(self, *labels: object) -> float:
        """A number in [0, 1) from the seed and ``labels`` (SHA-256: the same on every platform and version)."""
        text = "\0".join(map(str, labels)).encode()
        word = hashlib.sha256(struct.pack("<Q", self.seed) + b"challenge\0" + text).digest()[:8]
        return int.from_bytes(word, "little") / 2.0**64


def survival_probability(rate: float, micro_batches: int, k_steps: int, corrupted: int | None = None,
                         detection: float = 1.0) -> float:
    """The probability that a member corrupting ``corrupted`` (default: all) of its ``micro_batches`` every step
    is never caught in ``k_steps`` steps, each checked micro-batch that is corrupt caught with probability
    ``detection``: per step ``Σ_n P(n checked) Σ_j Hyp(j | M, c, n) (1 − detection)^j``."""
    corrupted = micro_batches if corrupted is None else corrupted
    if micro_batches < 1 or not 0 <= corrupted <= micro_batches or k_steps < 0:
        raise ValueError(f"need 0 ≤ corrupted ≤ micro_batches ≥ 1 and k_steps ≥ 0, got {corrupted}, "
                         f"{micro_batches}, {k_steps}")
    if not (0 <= rate <= 1 and 0 <= detection <= 1):
        raise ValueError(f"rate and detection lie in [0, 1], got {rate}, {detection}")
    expected = micro_batches * rate
    low = math.floor(expected)
    per_step = 0.0
    for n, p_n in ((low, 1 - (expected - low)), (low + 1, expected - low)):
        if p_n <= 0 or n > micro_batches:
            continue
        for j in range(0, min(n, corrupted) + 1):
            hyper = math.comb(corrupted, j) * math.comb(micro_batches - corrupted, n - j) / math.comb(micro_batches, n)
            per_step += p_n * hyper * (1 - detection) ** j
    return per_step**k_steps
