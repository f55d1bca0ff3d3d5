"""Which DHT entries are accepted: admission by every DHT node, and verification by every reader.

Two layers, on purpose:

1. **Admission** (``SwarmRecordValidator``, a hivemind ``RecordValidatorBase``), run by the DHT process of
   every node on every store and on every response it receives, after hivemind's ``RSASignatureValidator``
   has checked and stripped the signature. Under a run's keys it admits only entries whose subkey is
   exactly one owner mark (so unsigned entries, and plain values that would replace the whole dictionary,
   are refused), whose value is bytes under the size cap, and whose expiration is at most ``MAX_TTL_S``
   ahead. These rules never change between p2ptrain versions.

2. **Verification** (``verify_entries``), run by the reader in the agent process on everything it gets:
   the strict, versioned record schema (``records.py``) and the binding of each record to its writer
   (``identity.py``: the writer is the peer ID its owner key hashes to; a plan must be signed by the
   leader it names; a peer record may only advertise its own addresses). Failures are logged and ignored,
   one entry at a time.

Why not check the schema at admission too: hivemind drops a node's *whole* dictionary response when a
single subkey fails validation (``DHTProtocol._validate_dictionary``), so a schema check in the DHT would
let one entry written by a newer p2ptrain (or a bug) blind older readers to every peer; and log lines
written in the DHT process are not where an operator reads the agent's log.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.net.dht.admission import MAX_TOKEN_BYTES, AdmissionPolicy, token_of
from p2ptrain.net.dht.keys import RecordKind, RunKeys
from p2ptrain.net.dht.records import (
    MAX_RECORD_BYTES,
    PeerRecord,
    PlanRecord,
    Record,
    RecordError,
    decode_record,
)
from p2ptrain.net.identity import peer_id_of_owner_mark
from p2ptrain.net.nat.relay import target_peer

logger = logging.getLogger(__name__)

MAX_TTL_S = 24 * 3600.0  # no entry under a run key may be stored to live longer than this
_CLOCK_SLACK_S = 60.0  # tolerated clock skew between peers when checking expirations
VERDICTS_KEPT = 4096  # signature checks remembered by a node (``SignatureValidator.validate``)

R = TypeVar("R")


@dataclass(frozen=True)
class Verified(Generic[R]):
    """A record that passed verification, with the peer that wrote it and when the entry expires."""

    peer_id: str
    record: R
    expiration_time: float


class RateLimitedLog:
    """Logs a warning once per ``period_s`` for each distinct key, debug otherwise: a rogue peer rewriting a
    bad entry every second must not flood the log, yet the first occurrence is always visible."""

    def __init__(self, log: logging.Logger, period_s: float = 60.0):
        self._log, self._period_s = log, period_s
        self._last: dict[tuple[str, ...], float] = {}

    def warning(self, key: tuple[str, ...], message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._period_s) >= self._period_s:
            self._last[key] = now
            if len(self._last) > 10_000:  # bound memory under a flood of distinct keys
                self._last = {k: t for k, t in self._last.items() if now - t < self._period_s}
            self._log.warning(message, *args)
        else:
            self._log.debug(message, *args)


def run_key_ids(run_ids: Iterable[str]) -> dict[bytes, str]:
    """The DHT IDs (as a ``DHTRecord.key`` holds them) of the given runs' keys, mapped to the key names."""
    return {DHTID.generate(source=key).to_bytes(): key for run in run_ids for key in RunKeys(run).every_key()}


class SignatureValidator(RSASignatureValidator):
    """hivemind's RSA signature check (an owner-marked entry must carry its owner's signature), with a
    warning for an entry it refuses under a run's keys: hivemind logs that at debug level only, and a
    tampered entry (or one signed with another key than its subkey names) deserves a visible line."""

    def __init__(self, private_key: RSAPrivateKey, run_ids: Iterable[str]):
        super().__init__(private_key)
        self._keys = run_key_ids(run_ids)
        self._log = RateLimitedLog(logger)
        self._verdicts: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._lock = threading.Lock()

    def validate(self, record: DHTRecord) -> bool:
        """hivemind's check, remembered by the digest of all the entry's bytes (key, subkey, value, expiration:
        what the signature covers): every read of a run's key gets a copy of each entry from each node it asks,
        a dozen times over until the entry is replaced, and each check parsed the owner's key and verified an
        RSA signature, milliseconds on a loaded machine (``benchmarks/dht_load.py``)."""
        digest = hashlib.blake2b(digest_size=20)
        for part in (record.key, record.subkey or b"", record.value, struct.pack("<d", record.expiration_time)):
            digest.update(struct.pack("<Q", len(part)) + part)  # each part's length first: no two entries spell alike
        with self._lock:
            ok = self._verdicts.get(digest.digest())
        if ok is None:
            ok = super().validate(record)
            with self._lock:
                self._verdicts[digest.digest()] = ok
                if len(self._verdicts) > VERDICTS_KEPT:
                    self._verdicts.popitem(last=False)
        key = self._keys.get(record.key)
        if not ok and key is not None:
            self._log.warning((key, "signature"), "DHT refuses an entry under %s: its signature does not match "
                              "the owner key in its subkey (tampered, or not signed by that owner)", key)
        return ok


class SwarmRecordValidator(RecordValidatorBase):
    """Admission rules for the keys of the given runs (other keys pass untouched); see the module docstring.
    ``policies``: closed runs' admission (``admission.py``), by run."""

    def __init__(self, run_ids: Iterable[str], policies: Mapping[str, AdmissionPolicy] | None = None):
        self._keys: dict[bytes, str] = run_key_ids(run_ids)
        self._policies = {run: p for run, p in (policies or {}).items() if p.closed}
        self._log = RateLimitedLog(logger)

    def validate(self, record: DHTRecord) -> bool:
        key = self._keys.get(record.key)
        if key is None:
            return True
        try:
            writer = peer_id_of_owner_mark(MSGPackSerializer.loads(record.subkey))
            value = MSGPackSerializer.loads(record.value)
            if not isinstance(value, bytes):
                raise ValueError(f"value is {type(value).__name__}, not bytes")
            policy = self._policies.get(key.split(".", 1)[0])
            cap = MAX_RECORD_BYTES + (MAX_TOKEN_BYTES + 32 if policy is not None else 0)  # a closed run's token
            if len(value) > cap:
                raise ValueError(f"value is {len(value)} bytes, over the {cap}-byte cap")
            refusal = policy.refusal(writer, token_of(value)) if policy is not None else None
            if refusal is not None:
                raise ValueError(f"peer {writer} is {refusal}" if refusal.startswith("not") else f"peer {writer}: {refusal}")
            if record.expiration_time > get_dht_time() + MAX_TTL_S + _CLOCK_SLACK_S:
                raise ValueError(f"expiration is more than {MAX_TTL_S:.0f} s ahead")
        except Exception as e:  # msgpack and key parsing raise various types for garbage
            self._log.warning((key, str(e)), "DHT refuses an entry under %s: %s", key, e)
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator (10): validated after the signature is checked and stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SwarmRecordValidator):
            return False
        self._keys.update(other._keys)  # same rules, more keys
        self._policies.update(other._policies)
        return True


def verify_entries(
    kind: RecordKind, entries: Mapping[Any, Any], log: RateLimitedLog | None = None,
    policy: AdmissionPolicy | None = None,
) -> dict[str, Verified[Record]]:
    """The valid records among the ``{subkey: ValueWithExpiration}`` a DHT get returned, by writer's peer ID.

    Each invalid entry is logged (peer, reason) and skipped; the others are unaffected. With a closed run's
    ``policy``, entries of writers it does not admit are skipped too.
    """
    log = log or RateLimitedLog(logger)
    verified: dict[str, Verified[Record]] = {}
    for subkey, item in entries.items():
        peer_id = "?"
        try:
            peer_id, raw = admitted_entry(subkey, item, policy)
            record = decode_record(kind, raw)
            check_binding(peer_id, record)
        except (RecordError, ValueError) as e:
            log.warning(
                (kind.value, peer_id, str(e)), "ignoring %s entry from peer %s: %s", kind.value, peer_id, e
            )
            continue
        verified[peer_id] = Verified(peer_id, record, float(getattr(item, "expiration_time", 0.0)))
    return verified


def admitted_entry(subkey: Any, item: Any, policy: AdmissionPolicy | None) -> tuple[str, Any]:
    """The writer (by the entry's owner mark) and the raw value of one ``{subkey: entry}`` of a DHT get;
    ValueError for a subkey that is no owner mark, RecordError for a writer a closed run does not admit."""
    peer_id = peer_id_of_owner_mark(subkey)
    raw = getattr(item, "value", item)
    refusal = policy.refusal(peer_id, token_of(raw)) if policy is not None else None
    if refusal is not None:
        raise RecordError(refusal)
    return peer_id, raw


def check_binding(peer_id: str, record: Record) -> None:
    """RecordError unless ``record`` may have been written by ``peer_id`` (the peer its subkey's key gives)."""
    if isinstance(record, PlanRecord) and record.leader != peer_id:
        raise RecordError(
            f"plan record signed by {peer_id} names {record.leader} as leader (its member at leader_at); "
            "only that leader may sign it"
        )
    if isinstance(record, PeerRecord):
        for maddr in record.maddrs:  # the last /p2p/ names the peer (a circuit address names its relay first)
            target = target_peer(maddr)
            if target is not None and target != peer_id:
                raise RecordError(f"peer record advertises an address of another peer: {maddr}")
