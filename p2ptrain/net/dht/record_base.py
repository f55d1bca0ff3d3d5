"""What every DHT record shares (``records``, ``plan_record``): the msgpack envelope under the size cap, the
bounds on what a record may claim, and the strict field helpers the record types decode with."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack

from p2ptrain.net.dht import fields as f
from p2ptrain.net.dht.fields import RecordError, RecordTooLarge
from p2ptrain.net.dht.keys import PLAN_PARTS, RecordKind
from p2ptrain.net.identity import PEER_ID_BYTES, peer_id_from_bytes, peer_id_to_bytes

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 24 * 1024
MAX_LINK_PEERS = 1024
MAX_ROW_VERSION = 2**32 - 1  # a links row's version and a plan's (uint32 on the wire): unix seconds until 2106
MAX_PLAN_PEERS = 4096
PART_BYTES = 16 * 1024  # a plan is stored in parts of at most this many bytes (``plan_store``)
MAX_PLAN_BYTES = PLAN_PARTS * PART_BYTES  # an encoded plan: 36 bytes a member, and its grid and lists
PEER_TAG_BYTES = 8
PLAN_DIGEST_BYTES = 16  # a plan's digest (``PlanRecord.digest``), as a progress record names the plan it trains
SOURCE_CHECKPOINT = 0xFFFF  # PlanRecord.sources: the stage's state comes from the last complete checkpoint
SOURCE_INIT = 0xFFFE  # ... from the seed (step 0)
NO_BACKUP = 0xFFFF  # PlanRecord.backups: nobody keeps a copy of this stage
MAX_KEPT_STATES = 16
MAX_HOLDS = 32
MAX_BASELINES = 8

# Claims beyond any real device are refused (the record is ignored, with its reason logged): the largest
# accelerator holds 288 GB and the largest volunteer host is far below 8 TiB of RAM (a CPU agent reports
# its RAM); the fastest accelerator's dense bf16 peak is ~2.5 PFLOP/s; no single link of one peer carries
# 1 Tbit/s.
MAX_MEMORY_GB = 8192.0
MAX_TFLOPS = 10_000.0
MAX_LATENCY_MS = 60_000.0
MAX_BANDWIDTH_GBPS = 1_000.0
MAX_COST_S = 1e9
MAX_BUCKET_ELEMENTS = 1 << 40  # elements per all-reduce bucket (``runtime.buckets``)
MAX_SLOWDOWN = 1e4  # a plan may price a member at most this many times slower than its record
MAX_STEP_TIME_S = 1e6
MAX_ABS_LOSS = 1e9
MAX_COUNTER = 2**53
MAX_MADDRS = 16

VERSION_RE = re.compile(r"[0-9A-Za-z.+_-]{1,32}")
IDENT_RE = re.compile(r"[a-z0-9_-]{1,32}")
DATA_RE = re.compile(r"[a-z0-9]{1,16}-[0-9]{1,8}:[0-9a-f]{16}")  # tokenizer label : content digest
SETTINGS_RE = re.compile(r"[a-z0-9_]{1,24}=[a-z0-9_.]{1,24}(,[a-z0-9_]{1,24}=[a-z0-9_.]{1,24}){0,15}")  # k=v,...


def peer_tag(peer_id: str) -> bytes:
    """The 8-byte name of a peer inside a links row (64 bits: accidental collisions are negligible, and
    forging one costs ~2^64 RSA key generations)."""
    return hashlib.sha256(peer_id_to_bytes(peer_id)).digest()[:PEER_TAG_BYTES]


class RecordEnvelope:
    """Shared envelope: ``encode`` to msgpack bytes under the cap, ``decode`` strictly."""

    kind: ClassVar[RecordKind]
    max_bytes: ClassVar[int] = MAX_RECORD_BYTES  # one DHT value; a plan is stored in parts (``plan_store``)

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> RecordEnvelope:
        raise NotImplementedError

    def encode(self) -> bytes:
        data = msgpack.packb(
            {"v": SCHEMA_VERSION, "kind": self.kind.value, **self._fields()}, use_bin_type=True
        )
        if len(data) > self.max_bytes:
            raise RecordTooLarge(
                f"{self.kind.value} record is {len(data)} bytes, over the {self.max_bytes}-byte cap of its DHT values"
            )
        return data

    @classmethod
    def decode(cls, data: object) -> Any:
        m = unpack_map(cls.kind.value, data, cls.max_bytes)
        try:
            return cls._from_fields(m)
        except KeyError as e:
            raise RecordError(f"{cls.kind.value} record: missing field {e.args[0]}") from None
        except RecordError as e:
            raise RecordError(f"{cls.kind.value} record: {e}") from None


def unpack_map(kind: str, data: object, cap: int = MAX_RECORD_BYTES) -> Mapping[str, Any]:
    """The envelope's map of bytes read as a ``kind`` value (``v`` and ``kind`` checked); RecordError if not."""
    if not isinstance(data, bytes):
        raise RecordError(f"{kind} record: value is {type(data).__name__}, not bytes")
    if len(data) > cap:
        raise RecordTooLarge(f"{kind} record: {len(data)} bytes, over the {cap}-byte cap")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Exception as e:  # msgpack raises many unrelated types (ValueError, ExtraData, FormatError, ...)
        raise RecordError(f"{kind} record: not a msgpack map ({type(e).__name__})") from None
    if not isinstance(m, dict):
        raise RecordError(f"{kind} record: not a msgpack map")
    if m.get("v") != SCHEMA_VERSION or isinstance(m.get("v"), bool):
        raise RecordError(
            f"{kind} record: schema version {m.get('v')!r} is not {SCHEMA_VERSION} (peer runs another p2ptrain)"
        )
    if m.get("kind") != kind:
        raise RecordError(f"{kind} record: its kind field says {m.get('kind')!r}")
    return m


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def set_field(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def peer_from_bytes(name: str, raw: object) -> str | None:
    if raw is None:
        return None
    data = f.binary(name, raw, item_size=PEER_ID_BYTES, max_items=1)
    if not data:
        raise RecordError(f"{name} must name one peer")
    try:
        return peer_id_from_bytes(data)
    except ValueError as e:
        raise RecordError(f"{name}: {e}") from None
