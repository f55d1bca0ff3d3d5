"""A plan as a head and its parts (``net.dht.plan_store``): split, joined only when every part matches its head,
read once per digest, bound to its signer."""

from __future__ import annotations

import dataclasses
import logging
import random
from types import SimpleNamespace

import base58
from hivemind.utils import get_dht_time

from p2ptrain.net.dht.plan_store import PlanPart, PlanReader, split
from p2ptrain.net.dht.record_base import MAX_RECORD_BYTES, PART_BYTES
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.dht.validators import RateLimitedLog
from p2ptrain.net.identity import generate_identity


def fake_peer_ids(n: int, seed: int = 0) -> list[str]:
    """Well-formed peer IDs (sha2-256 multihashes of random digests), sorted."""
    rng = random.Random(seed)
    return sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(n))


LEADER, OTHER = sorted((generate_identity() for _ in range(2)), key=lambda i: i.peer_id)


def big_plan(members: int, signer=LEADER, epoch: int = 3) -> PlanRecord:
    """A plan of ``members`` (fake peers beside ``signer``), 8 stages; ``signer`` leads it."""
    peers = sorted([signer.peer_id, *fake_peer_ids(members - 1, seed=epoch)])
    replicas = members // 8
    return PlanRecord(epoch=epoch, membership=tuple(peers), stages=8, replicas=replicas,
                      pipelines=tuple(tuple(i * 8 + j for j in range(8)) for i in range(replicas)), cost_s=1.5,
                      leader_at=peers.index(signer.peer_id))


def entry(value: bytes, ttl_s: float = 60.0) -> SimpleNamespace:
    return SimpleNamespace(value=value, expiration_time=get_dht_time() + ttl_s)


class Store:
    """The part keys' entries, by index and signer's subkey; counts the reads of parts."""

    def __init__(self):
        self.parts: dict[int, dict[bytes, SimpleNamespace]] = {}
        self.reads = 0

    def put(self, identity, parts) -> None:
        for part in parts:
            self.parts.setdefault(part.index, {})[identity.owner_mark] = entry(part.encode())

    def get(self, indices):
        self.reads += 1
        return {i: self.parts.get(i, {}) for i in indices}


def test_a_plan_of_a_thousand_members_is_stored_in_parts_and_read_once_per_digest():
    plan = big_plan(1000)
    head, parts = split(plan)
    assert head.parts == len(parts) == 3 and all(len(p.data) <= PART_BYTES for p in parts)
    assert all(len(p.encode()) <= MAX_RECORD_BYTES for p in parts) and len(head.encode()) < 100
    store, reader = Store(), PlanReader(RateLimitedLog(logging.getLogger("test")))
    store.put(LEADER, parts)
    heads = {LEADER.owner_mark: entry(head.encode())}
    for _ in range(3):
        got = reader.read(heads, store.get, get_dht_time())
        assert got[LEADER.peer_id].record == plan
    assert store.reads == 1  # the next polls read the head alone


def test_parts_of_another_plan_wait_for_the_next_poll_and_garbled_ones_are_refused_once(caplog):
    old, new = big_plan(600, epoch=3), big_plan(600, epoch=4)
    store, reader = Store(), PlanReader(RateLimitedLog(logging.getLogger("test")))
    store.put(LEADER, split(old)[1])
    heads = {LEADER.owner_mark: entry(split(new)[0].encode())}  # the new head, the old parts: mid-replacement
    caplog.set_level(logging.WARNING)
    assert reader.read(heads, store.get, get_dht_time()) == {} and caplog.text == ""
    store.put(LEADER, split(new)[1])
    assert reader.read(heads, store.get, get_dht_time())[LEADER.peer_id].record == new

    # parts that carry the head's digest but not its bytes: refused with a line, and not read again
    lying = big_plan(600, epoch=5)
    head, parts = split(lying)
    store.put(LEADER, [dataclasses.replace(parts[0], data=b"x" + parts[0].data[1:]), *parts[1:]])
    heads = {LEADER.owner_mark: entry(head.encode())}
    reads = store.reads
    assert reader.read(heads, store.get, get_dht_time()) == {}
    assert "do not hash to the digest" in caplog.text
    assert reader.read(heads, store.get, get_dht_time()) == {} and store.reads == reads + 1


def test_a_head_naming_another_signers_plan_or_another_signers_parts_is_not_theirs(caplog):
    plan = big_plan(40)
    head, parts = split(plan)
    store, reader = Store(), PlanReader(RateLimitedLog(logging.getLogger("test")))
    store.put(LEADER, parts)
    # OTHER copies the leader's head: the digest is known, but its plan names LEADER as its leader
    heads = {LEADER.owner_mark: entry(head.encode()), OTHER.owner_mark: entry(head.encode())}
    caplog.set_level(logging.WARNING)
    got = reader.read(heads, store.get, get_dht_time())
    assert set(got) == {LEADER.peer_id} and f"signed by {OTHER.peer_id} names {LEADER.peer_id}" in caplog.text
    # a head of OTHER's own plan whose parts sit under LEADER's subkey only: never joined for OTHER
    own = big_plan(40, signer=OTHER, epoch=6)
    own_head, own_parts = split(own)
    store.put(LEADER, own_parts)
    assert reader.read({OTHER.owner_mark: entry(own_head.encode())}, store.get, get_dht_time()) == {}
    store.put(OTHER, own_parts)
    assert reader.read({OTHER.owner_mark: entry(own_head.encode())}, store.get, get_dht_time())[OTHER.peer_id].record == own


def test_an_expired_head_and_a_garbled_part_are_ignored():
    plan = big_plan(16)
    head, parts = split(plan)
    store, reader = Store(), PlanReader(RateLimitedLog(logging.getLogger("test")))
    store.put(LEADER, parts)
    assert reader.read({LEADER.owner_mark: entry(head.encode(), ttl_s=-1)}, store.get, get_dht_time()) == {}
    store.parts[0][LEADER.owner_mark] = entry(b"\x81\xa1v\x01")  # a map without the part's fields
    assert reader.read({LEADER.owner_mark: entry(head.encode())}, store.get, get_dht_time()) == {}
    assert PlanPart.decode(parts[0].encode()) == parts[0]
