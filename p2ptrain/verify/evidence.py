"""Evidence of a failed recompute that a third party re-checks: what it is, on the wire and in a heartbeat. Pure.

A verifier that finds a member's message is not what its input gives (``recompute_check``) holds everything a
judge needs to redo the check without trusting it:

- the member's own **signed commitment** of the step (``pipe_commit``): the digests of every pipeline message it
  sent and received, and the digest of the parameters it computed with (``param_digest``), so the member is bound
  to the messages and the parameters before anyone knew which micro-batch would be checked;
- the **revealed messages** of the checked micro-batch (as they travelled), each of which must match its
  digest in that commitment: a verifier cannot change a byte of them;
- the **parameters** the step computed with (its own copy: replicas' are bit-identical), which must match the
  member's signed digest: a verifier cannot hand the judge other weights.

That is the *bulk*, far over a heartbeat's 16 KiB (a stage's parameters): it travels to the leader as messages
of kind ``evidence`` (parts of at most ``PART_BYTES``), announced by a small *header* in the finder's halted
heartbeat (``ProgressRecord.evidence``): which step, stage, member and micro-batch, and the bulk's size and
SHA-256, so the finder is bound to the bulk it announced. The judgement is ``verify.dispute``'s.

A *shard dispute* (``ShardHeader``: an owner's signed sketch statement misdescribes a message of the all-reduce it
accepted, ``verify.sum_check`` checks ``claim`` and ``attest``) travels the same way: its bulk holds every member's
signed commitment of the step and the owner's statement (laid end to end in ``Bulk.commitment``) and the disputed
message (``Bulk.messages``, keyed ``("shard", check, bucket)``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from blake3 import blake3

from p2ptrain.verify.commit import message_digest

MAGIC = b"p2ptrain/recompute-evidence/1\n"  # a heartbeat's evidence that is a recompute dispute's header
PART_BYTES = 64 << 20  # the bulk travels in messages of at most this many bytes
_LENGTH = struct.Struct("<Q")
_MAX_INDEX_BYTES = 1 << 20  # a bulk's index (JSON): names, dtypes, shapes
# what a bulk may carry: parameters (fp32 or bf16 masters), messages as the wire codecs make them
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                    torch.uint8, torch.int8)}
MAX_HEADER_BYTES = 1024


def param_digest(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """BLAKE3 (32 bytes) of a stage's parameters, in the order given (a module's ``named_parameters``): each
    one's ``message_digest`` under its name (dtype, shape and bytes), chained."""
    h = blake3(b"p2ptrain.verify.params\0")
    for name, tensor in named:
        h.update(message_digest(tensor, f"param/{name}"))
    return h.digest()


@dataclass(frozen=True)
class DisputeHeader:
    """What a finder's halted heartbeat says of its evidence against ``member`` (stage ``stage``, replica
    ``replica``): the step and micro-batch it recomputed, the ratio it found (over the allowance), and the bulk
    it sends the leader: ``bulk_bytes`` bytes of SHA-256 ``bulk_sha256`` (hex)."""

    epoch: int
    step: int
    stage: int
    replica: int
    member: str
    micro_batch: int
    ratio: float
    bulk_bytes: int
    bulk_sha256: str

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        fields["ratio"] = self.ratio if math.isfinite(self.ratio) else None
        return _header_bytes(MAGIC, fields)

    @classmethod
    def from_bytes(cls, blob: bytes) -> DisputeHeader:
        """The header of ``blob``; ValueError (one line) for anything else."""
        fields = _header_fields(blob, MAGIC, cls, ("epoch", "step", "stage", "replica", "micro_batch", "bulk_bytes"),
                                ("member",), "a dispute header")
        ratio = fields["ratio"]
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float)):
            raise ValueError("a dispute header whose ratio is not a number")
        fields["ratio"] = math.inf if ratio is None else float(ratio)
        return cls(**fields)


SHARD_MAGIC = b"p2ptrain/shard-evidence/1\n"  # a heartbeat's evidence that is a shard dispute's header
SHARD_CHECKS = ("claim", "attest")


@dataclass(frozen=True)
class ShardHeader:
    """What a finder's halted heartbeat says of its evidence that owner ``member`` misdescribed a shard in its
    signed sketch statement (``verify.sum_check`` checks ``claim``: its own reduced shard of bucket ``bucket``;
    ``attest``: the finder's contribution to it), and of the bulk it sends the leader (``verify.dispute.
    judge_shard``): every member's signed commitment of the step, the owner's sketch statement and the disputed
    message, ``bulk_bytes`` bytes of SHA-256 ``bulk_sha256`` (hex)."""

    epoch: int
    step: int
    stage: int
    bucket: int
    member: str
    finder: str
    check: str
    bulk_bytes: int
    bulk_sha256: str

    def to_bytes(self) -> bytes:
        return _header_bytes(SHARD_MAGIC, asdict(self))

    @classmethod
    def from_bytes(cls, blob: bytes) -> ShardHeader:
        """The header of ``blob``; ValueError (one line) for anything else."""
        fields = _header_fields(blob, SHARD_MAGIC, cls, ("epoch", "step", "stage", "bucket", "bulk_bytes"),
                                ("member", "finder", "check"), "a shard dispute header")
        if fields["check"] not in SHARD_CHECKS:
            raise ValueError(f"a shard dispute header of check {fields['check']!r} (known: {', '.join(SHARD_CHECKS)})")
        return cls(**fields)


def _header_bytes(magic: bytes, fields: dict) -> bytes:
    blob = magic + json.dumps(fields, sort_keys=True).encode()
    assert len(blob) <= MAX_HEADER_BYTES, "a dispute header too long for a heartbeat"
    return blob


def _header_fields(blob: bytes, magic: bytes, cls: type, ints: tuple[str, ...], strings: tuple[str, ...],
                   what: str) -> dict:
    """The fields of a header ``blob`` of ``cls`` after ``magic``, its integers and strings checked; ValueError."""
    if bytes(blob[: len(magic)]) != magic or len(blob) > MAX_HEADER_BYTES:
        raise ValueError(f"not {what}")
    try:
        fields = json.loads(blob[len(magic):])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} that is not JSON: {e}") from None
    if not isinstance(fields, dict) or set(fields) != set(cls.__dataclass_fields__):
        raise ValueError(f"{what} with other fields than a header's")
    if any(isinstance(fields[k], bool) or not isinstance(fields[k], int) or fields[k] < 0 for k in ints):
        raise ValueError(f"{what} whose indices are not non-negative integers")
    if any(not isinstance(fields[k], str) for k in strings) or not isinstance(fields["bulk_sha256"], str) \
            or len(fields["bulk_sha256"]) != 64:
        raise ValueError(f"{what} whose member or SHA-256 is malformed")
    return fields


def is_recompute_evidence(evidence: bytes) -> bool:
    return bytes(evidence[: len(MAGIC)]) == MAGIC


def is_shard_evidence(evidence: bytes) -> bool:
    return bytes(evidence[: len(SHARD_MAGIC)]) == SHARD_MAGIC


def is_bulk_evidence(evidence: bytes) -> bool:
    """Whether a heartbeat's evidence announces a bulk sent to the leader (a recompute's or a shard's), which only
    the leader judges; else it is a signed statement anyone re-checks (``verify.attest.judge_evidence``)."""
    return is_recompute_evidence(evidence) or is_shard_evidence(evidence)


def evidence_check(evidence: bytes) -> str:
    """The check a heartbeat's evidence is of: ``recompute``, a shard dispute's (``claim``, ``attest``), or ``sum``
    (a signed statement)."""
    if is_recompute_evidence(evidence):
        return "recompute"
    if is_shard_evidence(evidence):
        try:
            return ShardHeader.from_bytes(evidence).check
        except ValueError:
            return "shard"
    return "sum"


@dataclass(frozen=True)
class Bulk:
    """A bulk, unpacked: the member's signed commitment (as it travelled, trimmed), the revealed messages by
    their place in it (``(direction, kind, micro_batch)``, ``recompute_check.entries``) and the parameters by name."""

    commitment: bytes
    messages: dict[tuple[str, str, int], torch.Tensor]
    params: list[tuple[str, torch.Tensor]]


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def pack(bulk: Bulk) -> bytes:
    """``bulk`` as bytes: the index's length, the index (JSON), the commitment, then every tensor's bytes."""
    tensors = [(list(e), t) for e, t in bulk.messages.items()] + [(n, t) for n, t in bulk.params]
    index = {"commitment": len(bulk.commitment), "messages": len(bulk.messages),
             "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]}
    text = json.dumps(index).encode()
    return b"".join([_LENGTH.pack(len(text)), text, bulk.commitment, *(_raw(t) for _, t in tensors)])


def unpack(blob: bytes) -> Bulk:
    """The bulk of ``blob``; ValueError (one line) for anything malformed (sizes, dtypes, shapes, names)."""
    view = memoryview(blob)
    if len(view) < _LENGTH.size:
        raise ValueError("a bulk shorter than its index's length")
    (n,) = _LENGTH.unpack_from(view)
    if n > _MAX_INDEX_BYTES or _LENGTH.size + n > len(view):
        raise ValueError(f"a bulk whose index ({n} bytes) does not fit it")
    try:
        index = json.loads(bytes(view[_LENGTH.size: _LENGTH.size + n]))
        commitment_n, messages_n, specs = index["commitment"], index["messages"], index["tensors"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"a bulk whose index is malformed: {e}") from None
    if not (isinstance(commitment_n, int) and isinstance(messages_n, int) and isinstance(specs, list)) \
            or not 0 <= messages_n <= len(specs):
        raise ValueError("a bulk whose index is malformed")
    offset = _LENGTH.size + n
    commitment = bytes(view[offset: offset + commitment_n])
    offset += commitment_n
    tensors = []
    for spec in specs:
        try:
            name, dtype_name, shape = spec
            dtype = DTYPES[dtype_name]
            numel = math.prod(shape)
            if not all(isinstance(s, int) and s >= 0 for s in shape):
                raise TypeError(shape)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"a bulk tensor's spec {spec!r} is malformed ({e!r})") from None
        size = numel * torch.tensor([], dtype=dtype).element_size()
        if offset + size > len(view):
            raise ValueError(f"a bulk whose tensor {name!r} ({size} bytes) runs past its end")
        raw = torch.frombuffer(bytearray(view[offset: offset + size]), dtype=torch.uint8) if size else \
            torch.empty(0, dtype=torch.uint8)
        tensors.append((name, raw.view(dtype).reshape(shape)))
        offset += size
    if offset != len(view):
        raise ValueError(f"a bulk with {len(view) - offset} bytes after its tensors")
    messages = {}
    for name, tensor in tensors[:messages_n]:
        if not (isinstance(name, list) and len(name) == 3 and all(isinstance(x, str) for x in name[:2])
                and isinstance(name[2], int)):
            raise ValueError(f"a bulk message's name {name!r} is not an entry")
        messages[(name[0], name[1], name[2])] = tensor
    params = []
    for name, tensor in tensors[messages_n:]:
        if not isinstance(name, str):
            raise ValueError(f"a bulk parameter's name {name!r} is not a string")
        params.append((name, tensor))
    return Bulk(commitment, messages, params)


def parts(nbytes: int) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of a bulk's messages."""
    return [(s, min(nbytes, s + PART_BYTES)) for s in range(0, max(nbytes, 1), PART_BYTES)]
