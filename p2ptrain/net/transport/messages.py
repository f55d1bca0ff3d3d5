"""What a tensor message says about itself: its kind, tag and header, why a receiver refuses it, and how
tensors become bytes and back.

Pure (torch only, no libp2p). A message on the wire is a stream of pieces; the first carries the header as
JSON, every piece carries the tag's key, and the payload bytes follow in order (see ``servicer.py``). The
sender's peer ID is not in the header: the receiver takes it from the libp2p connection.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch

MESSAGE_HEADER_VERSION = 1  # a message header's "v"; a receiver refuses a header of another version
MAX_HEADER_BYTES = 4096
MAX_RANK = 8
MAX_INDEX = 2**31 - 1

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: a str Enum whose str() and format() are its value, as 3.11's StrEnum

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class MessageKind(StrEnum):
    """Every kind of message p2ptrain sends, spelled as a tag carries it on the wire (a member is its string).

    A receiver takes any kind of the same shape (``Tag``): peers send strings, and a kind it does not know is
    judged as "any other kind" (``agent.tag_senders``)."""

    ACTIVATION = "activation"  # a stage's output, to the next stage of its pipeline (``runtime.executor``)
    ACTIVATION_GRAD = "activation_grad"  # the gradient of a stage's input, back to the stage before it
    REDUCE_SHARD = "reduce_shard"  # a shard of a gradient, to the replica that sums it (``runtime.allreduce``)
    GATHER_SHARD = "gather_shard"  # a summed shard, from that replica to every other
    COMMIT = "commit"  # a member's signed digests of the all-reduce messages it sent in a step (``verify.sum_check``)
    SKETCH = "sketch"  # an owner's signed sketches of the shards it summed, once the step's seed is known
    # a member's signed digests of every pipeline message it sent and received in a step, to its replica group and
    # pipeline neighbours (``verify.recompute_check``)
    PIPE_COMMIT = "pipe_commit"
    REVEAL = "reveal"  # a pipeline message of a challenged micro-batch, to the replica that recomputes it
    GRAD_NORM = "grad_norm"  # a stage's squared gradient norm, to the other stages of its pipeline (``model.clip``)
    PROBE = "probe"  # a link probe (``probe_session``), answered by ``rpc_probe``, never kept in a mailbox
    STATE = "state"  # a stage's training state, to a peer that takes the stage over (``agent.churn.stage_state``)
    BACKUP = "backup"  # a stage's state, copied to a peer that keeps it warm (``agent.churn.warm_copies``)
    BENCH = "bench"  # the transport benchmark's messages (``p2ptrain.bench.transport``)
    # a finder's evidence of a failed recompute, to the leader that judges it (``verify.evidence``): part ``part``
    EVIDENCE = "evidence"


# Kinds judged by epoch only: they are sent in the background and may arrive after the receiver's own
# training moved past their step.
EPOCH_ONLY_KINDS = frozenset({MessageKind.BACKUP, MessageKind.EVIDENCE})
# Kinds an epoch's abort (``Transport.abort_epoch``) does not cut short: exchanged once their epoch has failed
# (a finder's evidence, which the leader judges after the epoch halted); their own deadlines still hold.
UNABORTED_KINDS = frozenset({MessageKind.EVIDENCE})


class Refusal(StrEnum):
    """Why a receiver refused a message, in a word a sender can act on: a refusal reply's ``code`` on the wire
    (``replies.make_reply``) and ``MessageRejected.code``."""

    REFUSED = "refused"  # anything else: malformed, or not what the receiver expects (run, shape, size, ...)
    DUPLICATE = "duplicate"  # the receiver already holds this message from this sender
    STALE = "stale"  # the receiver has moved past the message's step
    # the receiver has not reached the message's epoch or step yet (it still halts an older epoch, or checks the
    # plan it is taking up): a training message waits for it under its call deadline (``Transport.send``)
    AHEAD = "ahead"
    # the sender is in none of the receiver's plans and not a live peer, or the plan of the tag's epoch does
    # not have it send that tag (``agent.tag_senders``)
    NOT_SENDER = "not_sender"
    TOO_SLOW = "too_slow"  # the payload arrived far slower than the link allows and was cut off
    # an earlier copy from this sender is still arriving (a resend raced the end of the stream that carried it):
    # worth sending again shortly
    ARRIVING = "arriving"
    # a probe stream opened while the receiver serves another, or measures the prober or its own line
    # (``probe_gate``): measure it again shortly
    BUSY = "busy"

    @classmethod
    def from_wire(cls, code: object) -> Refusal:
        """The refusal a peer's reply names; ``REFUSED`` for a code this version does not know."""
        return cls(code) if isinstance(code, str) and code in cls._value2member_map_ else cls.REFUSED

_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_RUN = re.compile(r"[A-Za-z0-9._-]{1,128}")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ValueError for dtypes the transport does not carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent (supported: {', '.join(DTYPES)})") from None


@dataclass(frozen=True, order=True)
class Tag:
    """Names one message of a run. A receiver holds at most one message per (tag, sender).

    ``kind`` is a ``MessageKind`` where this peer builds the tag, and the plain string where it decodes one."""

    run: str
    epoch: int
    step: int
    kind: str
    micro_batch: int = 0
    part: int = 0

    def __post_init__(self):
        if not isinstance(self.run, str) or not _RUN.fullmatch(self.run):
            raise ValueError(f"tag run must be 1-128 characters of [A-Za-z0-9._-], got {self.run!r}")
        if not isinstance(self.kind, str) or not _KIND.fullmatch(self.kind):
            raise ValueError(f"tag kind must be a lowercase identifier of at most 32 characters, got {self.kind!r}")
        for name in ("epoch", "step", "micro_batch", "part"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INDEX:
                raise ValueError(f"tag {name} must be an integer in 0..{MAX_INDEX}, got {value!r}")

    @property
    def key(self) -> str:
        """A compact string naming the tag, repeated on every piece of a message."""
        return f"{self.run}/{self.epoch}/{self.step}/{self.kind}/{self.micro_batch}/{self.part}"

    def __str__(self) -> str:
        return f"{self.kind}[run={self.run} epoch={self.epoch} step={self.step} mb={self.micro_batch} part={self.part}]"


@dataclass(frozen=True)
class Stamp:
    """A time on a named monotonic clock: ``time.monotonic()`` seconds of the processes whose clock is ``clock``
    (the machine's boot ID, see ``pacing.clock_domain``)."""

    clock: str
    time_s: float

    def __post_init__(self):
        if not isinstance(self.clock, str) or not 0 < len(self.clock) <= 64:
            raise ValueError("a stamp's clock must be a string of 1-64 characters")
        if isinstance(self.time_s, bool) or not isinstance(self.time_s, int | float) or not math.isfinite(self.time_s):
            raise ValueError(f"a stamp's time must be a finite number, got {self.time_s!r}")

    def to_json(self) -> list:
        return [self.clock, self.time_s]

    @classmethod
    def from_json(cls, value: object) -> Stamp:
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"a stamp must be [clock, time], got {value!r}")
        return cls(value[0], value[1])


@dataclass(frozen=True)
class Header:
    """The first piece's metadata: the tag, the tensor's dtype and shape, and (for probes) the reply size."""

    tag: Tag
    dtype: str
    shape: tuple[int, ...]
    reply_bytes: int = 0
    arrival: Stamp | None = None  # on emulated links: when the message arrives (see pacing.py)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if len(self.shape) > MAX_RANK or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"shape must be at most {MAX_RANK} non-negative integers, got {self.shape!r}")
        if isinstance(self.reply_bytes, bool) or not isinstance(self.reply_bytes, int) or self.reply_bytes < 0:
            raise ValueError(f"reply_bytes must be a non-negative integer, got {self.reply_bytes!r}")
        if self.arrival is not None and not isinstance(self.arrival, Stamp):
            raise ValueError("arrival must be a Stamp")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def encode(self) -> bytes:
        t = self.tag
        fields = dict(v=MESSAGE_HEADER_VERSION, run=t.run, epoch=t.epoch, step=t.step, kind=t.kind, mb=t.micro_batch,
                      part=t.part, dtype=self.dtype, shape=list(self.shape), nbytes=self.nbytes)
        if self.reply_bytes:
            fields["reply"] = self.reply_bytes
        if self.arrival is not None:
            fields["at"] = self.arrival.to_json()
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Header:
        """Parse and validate a header; ValueError (one line) for anything malformed."""
        if len(data) > MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("header is not valid JSON") from None
        if not isinstance(fields, dict):
            raise ValueError("header is not a JSON object")
        if fields.get("v") != MESSAGE_HEADER_VERSION:
            raise ValueError(f"header version {fields.get('v')!r} is not {MESSAGE_HEADER_VERSION}")
        try:
            tag = Tag(fields["run"], fields["epoch"], fields["step"], fields["kind"], fields["mb"], fields["part"])
            shape = fields["shape"]
            if not isinstance(shape, list):
                raise ValueError("shape is not a list")
            arrival = Stamp.from_json(fields["at"]) if "at" in fields else None
            header = cls(tag, fields["dtype"], tuple(shape), fields.get("reply", 0), arrival)
        except KeyError as e:
            raise ValueError(f"header lacks field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"header field has the wrong type: {e}") from None
        if fields.get("nbytes") != header.nbytes:
            raise ValueError(f"header announces {fields.get('nbytes')!r} bytes, its shape and dtype make {header.nbytes}")
        return header


@dataclass(frozen=True)
class BackupHeader:
    """Part 0 of a warm copy (kind ``backup``, ``agent.churn.warm_copies``): the training step the state is
    after, the SHA-256 of the flat float32 state, and the elements in each of the parts that follow. On the
    wire, ``SIZE_BYTES`` bytes sent as a uint8 tensor: the step (8 bytes little-endian), the digest, the
    elements per part (8 bytes little-endian)."""

    step: int
    digest: bytes
    part_numel: int

    _LAYOUT: ClassVar[struct.Struct] = struct.Struct("<Q32sQ")
    SIZE_BYTES: ClassVar[int] = _LAYOUT.size  # 48

    def __post_init__(self):
        for name in ("step", "part_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
                raise ValueError(f"a backup header's {name} must be an integer in 0..2**64-1, got {value!r}")
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError("a backup header's digest must be 32 bytes (SHA-256)")

    def pack(self) -> bytes:
        return self._LAYOUT.pack(self.step, self.digest, self.part_numel)

    @classmethod
    def unpack(cls, data: bytes) -> BackupHeader:
        """The header in ``data``; ValueError unless it is ``SIZE_BYTES`` long."""
        if len(data) != cls.SIZE_BYTES:
            raise ValueError(f"a backup header is {cls.SIZE_BYTES} bytes, got {len(data)}")
        return cls(*cls._LAYOUT.unpack(data))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of ``tensor``'s data in C order (so the caller may reuse the tensor at once)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor over ``data`` (no copy); ``len(data)`` must equal the shape's byte size."""
    if len(data) == 0:
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape)


def piece_bounds(size_bytes: int, chunk_bytes: int, tail_bytes: int = 0) -> list[tuple[int, int]]:
    """Byte ranges of the pieces of a message: chunks of ``chunk_bytes``, then a final piece of at most
    ``tail_bytes`` when ``tail_bytes`` > 0, so that an emulated link can hold back only a few bytes until the
    message's arrival time while the rest already streams. Always at least one (possibly empty) piece.
    """
    tail = min(tail_bytes, size_bytes) if tail_bytes > 0 else 0
    body = size_bytes - tail
    bounds = [(lo, min(lo + chunk_bytes, body)) for lo in range(0, body, chunk_bytes)]
    if tail or not bounds:
        bounds.append((body, size_bytes))
    return bounds
