"""A plan on the DHT: a small signed head under ``{run}.plan``, the plan itself in parts under ``{run}.plan.{i}``.

A plan names every member (36 bytes each): at 1,000 members it is about 37 kB, over one DHT value's cap, and
every follower reads the plan key every poll. So the leader stores its plan's encoding cut into parts of at
most ``PART_BYTES``, each under its own key ``{run}.plan.{i}`` (its owner-signed subkey, as every entry),
and then a head under ``{run}.plan``: the epoch, the SHA-256 of the encoding and the number of parts. A
reader reads the heads every poll (about 100 bytes a signer) and a plan's parts only for a digest it has
not assembled yet (``PlanReader``, which keeps the last few plans by digest): a plan crosses the DHT once
per reader and epoch, not once per poll, and a plan of up to ``MAX_PLAN_PEERS`` members fits.

    head, parts = split(plan)               # the writer: parts first, then the head
    reader = PlanReader(log)
    plans = reader.read(heads, get_parts)   # {signer: Verified[PlanRecord]}

What binds a plan to its signer: the head and every part sit under the signer's own subkey (hivemind checks
each entry's RSA signature), the parts must carry the head's digest and their index, and the joined bytes
must hash to it; the assembled plan then passes the checks of any plan record (``validators.check_binding``:
signed by the leader it names). Parts of another writer, of another plan or garbled are never joined: the
head is skipped until its parts match (a leader replacing its plan stores the new parts before the new
head, so a reader between the two sees the old head and new parts, and takes the plan at its next poll).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from p2ptrain.net.dht import fields as f
from p2ptrain.net.dht.admission import AdmissionPolicy
from p2ptrain.net.dht.fields import RecordError
from p2ptrain.net.dht.keys import PLAN_PARTS
from p2ptrain.net.dht.plan_record import PlanRecord
from p2ptrain.net.dht.record_base import MAX_COUNTER, PART_BYTES, SCHEMA_VERSION, unpack_map
from p2ptrain.net.dht.validators import RateLimitedLog, Verified, admitted_entry, check_binding
from p2ptrain.net.identity import peer_id_of_owner_mark

MAX_PLAN_PARTS = PLAN_PARTS
DIGEST_BYTES = 32
KEPT_PLANS = 16  # assembled plans a reader keeps by digest (the signers it sees, a few epochs each)


@dataclass(frozen=True)
class PlanHead:
    """What ``{run}.plan`` holds per signer: the plan's epoch, the SHA-256 of its encoding and its parts."""

    epoch: int
    digest: bytes
    parts: int

    def __post_init__(self) -> None:
        f.integer("epoch", self.epoch, 0, MAX_COUNTER)
        f.integer("parts", self.parts, 1, MAX_PLAN_PARTS)
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise RecordError(f"digest must be {DIGEST_BYTES} bytes")

    def encode(self) -> bytes:
        return msgpack.packb({"v": SCHEMA_VERSION, "kind": "plan", "epoch": self.epoch, "digest": self.digest,
                              "parts": self.parts}, use_bin_type=True)

    @classmethod
    def decode(cls, data: object) -> PlanHead:
        m = unpack_map("plan", data)
        try:
            return cls(epoch=m["epoch"], digest=m["digest"], parts=m["parts"])
        except KeyError as e:
            raise RecordError(f"plan head: missing field {e.args[0]}") from None
        except RecordError as e:
            raise RecordError(f"plan head: {e}") from None


@dataclass(frozen=True)
class PlanPart:
    """What ``{run}.plan.{index}`` holds per signer: bytes ``index × PART_BYTES`` on of the plan ``digest``."""

    digest: bytes
    index: int
    data: bytes

    def encode(self) -> bytes:
        return msgpack.packb({"v": SCHEMA_VERSION, "kind": "plan_part", "digest": self.digest, "index": self.index,
                              "data": self.data}, use_bin_type=True)

    @classmethod
    def decode(cls, data: object) -> PlanPart:
        m = unpack_map("plan_part", data)
        try:
            digest, index, chunk = m["digest"], f.integer("index", m["index"], 0, MAX_PLAN_PARTS - 1), m["data"]
        except KeyError as e:
            raise RecordError(f"plan part: missing field {e.args[0]}") from None
        if not isinstance(digest, bytes) or not isinstance(chunk, bytes) or len(chunk) > PART_BYTES:
            raise RecordError("plan part: digest and data must be bytes, data at most one part")
        return cls(digest, index, chunk)


def split(plan: PlanRecord) -> tuple[PlanHead, list[PlanPart]]:
    """The head and the parts that carry ``plan`` (``PlanRecord.encode``: RecordTooLarge past its cap)."""
    body = plan.encode()
    digest = hashlib.sha256(body).digest()
    chunks = [body[i:i + PART_BYTES] for i in range(0, len(body), PART_BYTES)]
    return PlanHead(plan.epoch, digest, len(chunks)), [PlanPart(digest, i, c) for i, c in enumerate(chunks)]


# a read of part keys: {key index: {subkey: entry}} for the indices asked (an entry has ``.value``)
GetParts = Callable[[Sequence[int]], Mapping[int, Mapping[Any, Any]]]


class PlanReader:
    """Plans from the heads a read of ``{run}.plan`` returned, their parts read only for new digests."""

    def __init__(self, log: RateLimitedLog):
        self._log = log
        self._plans: OrderedDict[bytes, PlanRecord] = OrderedDict()
        self._refused: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # (signer, digest): parts that lied

    def read(self, heads: Mapping[Any, Any], get_parts: GetParts, now: float,
             policy: AdmissionPolicy | None = None) -> dict[str, Verified[PlanRecord]]:
        """Every signer's plan whose head is valid and unexpired and whose parts match it; ``heads``: the
        ``{subkey: entry}`` of the plan key; ``get_parts(indices)``: the part keys' entries."""
        found: dict[str, tuple[PlanHead, float]] = {}
        for subkey, item in heads.items():
            signer = "?"
            try:
                signer, raw = admitted_entry(subkey, item, policy)
                head = PlanHead.decode(raw)
            except (RecordError, ValueError) as e:
                self._log.warning(("plan", signer, str(e)), "ignoring plan entry from peer %s: %s", signer, e)
                continue
            expires = float(getattr(item, "expiration_time", 0.0))
            if expires > now:
                found[signer] = (head, expires)
        missing = {s: h for s, (h, _) in found.items() if h.digest not in self._plans and (s, h.digest) not in self._refused}
        if missing:
            self._assemble(missing, get_parts(range(max(h.parts for h in missing.values()))))
        plans = {}
        for signer, (head, expires) in found.items():
            plan = self._plans.get(head.digest)
            if plan is None:
                continue
            try:
                check_binding(signer, plan)  # a head may name another signer's plan: bound per signer
            except RecordError as e:
                self._log.warning(("plan", signer, str(e)), "ignoring plan entry from peer %s: %s", signer, e)
                continue
            self._plans.move_to_end(head.digest)
            plans[signer] = Verified(signer, plan, expires)
        return plans

    def _assemble(self, heads: Mapping[str, PlanHead], parts: Mapping[int, Mapping[Any, Any]]) -> None:
        """Join each head's parts (its signer's entry under each part key) into its plan, where they match."""
        by_signer: dict[str, dict[int, Any]] = {}
        for index, entries in parts.items():
            for subkey, item in (entries or {}).items():
                try:
                    by_signer.setdefault(peer_id_of_owner_mark(subkey), {})[index] = getattr(item, "value", item)
                except ValueError:
                    continue  # admission refuses such subkeys; nothing of ours to say
        for signer, head in heads.items():
            raws = by_signer.get(signer, {})
            try:
                chunks = [PlanPart.decode(raws[i]) if i in raws else None for i in range(head.parts)]
                if any(c is None or c.digest != head.digest or c.index != i for i, c in enumerate(chunks)):
                    continue  # parts of another plan of the signer's, or not stored yet: the next poll
                body = b"".join(c.data for c in chunks)  # type: ignore[union-attr]
                if hashlib.sha256(body).digest() != head.digest:
                    raise RecordError("its parts do not hash to the digest its head says")
                plan = PlanRecord.decode(body)
                if plan.epoch != head.epoch:
                    raise RecordError(f"its head says epoch {head.epoch}, its plan {plan.epoch}")
            except (RecordError, ValueError) as e:  # parts signed with the head's digest that do not make it
                self._log.warning(("plan", signer, str(e)), "ignoring plan entry from peer %s: %s", signer, e)
                self._refused[(signer, head.digest)] = None
                while len(self._refused) > KEPT_PLANS:
                    self._refused.popitem(last=False)
                continue
            self._plans[head.digest] = plan
            while len(self._plans) > KEPT_PLANS:
                self._plans.popitem(last=False)
