"""Admission (what a DHT node stores), verification (what a reader accepts), identity binding, election."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from p2ptrain.agent.leadership.election import leader_of, select_plan, sorted_membership
from p2ptrain.errors import ConfigError
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import MAX_RECORD_BYTES, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.dht.validators import SignatureValidator, SwarmRecordValidator, verify_entries
from p2ptrain.net.identity import (
    check_peer_id,
    generate_identity,
    load_identity,
    load_or_create_identity,
    peer_id_of_owner_mark,
)

ALICE, BOB, ROGUE = (generate_identity() for _ in range(3))
LOW, HIGH = sorted([ALICE, BOB], key=lambda i: i.peer_id)


def dht_record(identity, key: str, value: object, subkey: object = None, ttl_s: float = 60.0) -> DHTRecord:
    subkey = identity.owner_mark if subkey is None else subkey
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value), expiration_time=get_dht_time() + ttl_s,
    )


def validators_of(identity) -> CompositeValidator:
    return CompositeValidator([RSASignatureValidator(identity.private_key), SwarmRecordValidator(["demo"])])


def signed(identity, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validators_of(identity).sign_value(record))


VALUE = ProgressRecord(1, 2, 3.0, 0.5).encode()


def tampered(record: DHTRecord) -> DHTRecord:
    value = bytearray(record.value)
    value[len(VALUE) // 2] ^= 0x01  # a bit of the payload, before the appended signature
    return dataclasses.replace(record, value=bytes(value))


def test_a_signed_entry_is_admitted_by_other_nodes():
    assert validators_of(BOB).validate(signed(ALICE, dht_record(ALICE, "demo.progress", VALUE)))


def test_a_nodes_signature_verdicts_are_remembered_per_entry_and_never_lent_to_another(monkeypatch):
    """A node checks an entry's signature once (``SignatureValidator``: every read brings each entry from each node
    asked); a tampered copy, or the entry with another expiration, is checked afresh and refused."""
    checks = []
    real = RSASignatureValidator.validate
    monkeypatch.setattr(RSASignatureValidator, "validate", lambda self, r: checks.append(r) or real(self, r))
    node = SignatureValidator(BOB.private_key, ["demo"])
    good = signed(ALICE, dht_record(ALICE, "demo.progress", VALUE))
    assert node.validate(good) and node.validate(dataclasses.replace(good)) and len(checks) == 1
    assert not node.validate(tampered(good)) and len(checks) == 2
    assert not node.validate(dataclasses.replace(good, expiration_time=good.expiration_time + 1))
    assert len(checks) == 3 and node.validate(good) and len(checks) == 3
    # fields that would spell the same bytes run together: the lengths come first
    joined = dataclasses.replace(good, key=good.key + good.subkey[:1], subkey=good.subkey[1:])
    assert not node.validate(joined) and len(checks) == 4


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: dht_record(ALICE, "demo.progress", VALUE), "unsigned owner entry"),
        (lambda: dht_record(ALICE, "demo.progress", VALUE, subkey=b"alice"), "plain subkey"),
        (lambda: dataclasses.replace(dht_record(ALICE, "demo.peers", VALUE), subkey=MSGPackSerializer.dumps(None)),
         "plain value replacing the dictionary"),
        (lambda: tampered(signed(ALICE, dht_record(ALICE, "demo.progress", VALUE))), "tampered value"),
        (lambda: dataclasses.replace(signed(ROGUE, dht_record(ROGUE, "demo.plan", VALUE)),
                                     subkey=MSGPackSerializer.dumps(ALICE.owner_mark)), "signed by another key"),
        (lambda: signed(ALICE, dht_record(ALICE, "demo.peers", b"x" * (MAX_RECORD_BYTES + 1))), "oversized"),
        (lambda: signed(ALICE, dht_record(ALICE, "demo.peers", {"not": "bytes"})), "not bytes"),
        (lambda: signed(ALICE, dht_record(ALICE, "demo.peers", VALUE, ttl_s=10 * 86400)), "expires too late"),
        (lambda: signed(ALICE, dht_record(ALICE, "demo.peers", VALUE,
                                          subkey=ALICE.owner_mark + b"x")), "owner mark with a suffix"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_entries_are_refused_at_admission(make, why):
    assert not validators_of(BOB).validate(make()), why


def test_other_keys_are_left_to_hivemind():
    assert validators_of(BOB).validate(dht_record(ALICE, "someone.else", b"anything", subkey=b"free"))


def entries(*items):
    return {subkey: ValueWithExpiration(value, get_dht_time() + 60) for subkey, value in items}


def plan_for(members, **overrides):
    members = sorted_membership(members)
    fields = dict(epoch=1, membership=members, stages=1, replicas=len(members),
                  pipelines=tuple((i,) for i in range(len(members))), cost_s=1.0)
    fields.update(overrides)
    return PlanRecord(**fields)


def test_verify_keys_records_by_the_peer_their_owner_key_gives(caplog):
    record = PeerRecord("cpu", 8.0, 0.1, maddrs=(f"/ip4/127.0.0.1/tcp/5/p2p/{ALICE.peer_id}",))
    got = verify_entries(RecordKind.PEER, entries((ALICE.owner_mark, record.encode())))
    assert list(got) == [ALICE.peer_id] and got[ALICE.peer_id].record == record
    assert not caplog.records


@pytest.mark.parametrize(
    "subkey, value, logged",
    [
        (b"alice", PeerRecord("cpu", 8.0, 0.1).encode(), "not an owner mark"),
        (b"[owner:ssh-rsa AAAAnotakey]", PeerRecord("cpu", 8.0, 0.1).encode(), "valid RSA public key"),
        (ROGUE.owner_mark, b"\x93garbage", "not a msgpack map"),
        (ROGUE.owner_mark, PeerRecord("cpu", 8.0, 0.1, maddrs=(f"/ip4/1.2.3.4/tcp/5/p2p/{ALICE.peer_id}",)).encode(),
         "advertises an address of another peer"),
    ],
)
def test_verify_ignores_bad_entries_with_a_log_line(caplog, subkey, value, logged):
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.dht.validators")
    good = (ALICE.owner_mark, PeerRecord("gpu", 80.0, 700.0).encode())
    got = verify_entries(RecordKind.PEER, entries(good, (subkey, value)))
    assert list(got) == [ALICE.peer_id]
    assert logged in caplog.text and "ignoring peers entry" in caplog.text


def test_a_plan_signed_by_anyone_but_the_leader_it_names_is_ignored(caplog):
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.dht.validators")
    members = [ALICE.peer_id, BOB.peer_id]
    forged = plan_for(members)  # names LOW as leader, but ROGUE's key signs it
    got = verify_entries(RecordKind.PLAN, entries((ROGUE.owner_mark, forged.encode()),
                                                  (LOW.owner_mark, plan_for(members, epoch=2).encode())))
    assert list(got) == [LOW.peer_id] and got[LOW.peer_id].record.epoch == 2
    assert f"plan record signed by {ROGUE.peer_id} names {LOW.peer_id} as leader" in caplog.text


def test_select_plan_follows_the_lowest_live_peer_for_the_live_membership(caplog):
    members = [ALICE.peer_id, BOB.peer_id]
    good = plan_for(members)
    assert select_plan({LOW.peer_id: good}, members) == good
    # another peer's self-consistent plan (it leads its own made-up membership): ignored, with a warning
    rogue_plan = plan_for([HIGH.peer_id])
    caplog.set_level(logging.INFO, logger="p2ptrain.agent.leadership.election")
    assert select_plan({HIGH.peer_id: rogue_plan, LOW.peer_id: good}, members) == good
    assert f"signed by {HIGH.peer_id}: the leader (lowest live peer) is {LOW.peer_id}" in caplog.text
    # the leader's plan for an older membership: not followed
    assert select_plan({LOW.peer_id: good}, [*members, ROGUE.peer_id]) is None
    assert select_plan({}, members) is None
    assert leader_of(members) == LOW.peer_id and leader_of([]) is None


def test_identity_file_gives_a_stable_peer_id(tmp_path):
    path = tmp_path / "id.key"
    first = load_or_create_identity(path)
    assert load_or_create_identity(path).peer_id == first.peer_id == check_peer_id(first.peer_id)
    assert peer_id_of_owner_mark(first.owner_mark) == first.peer_id
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    (tmp_path / "bad.key").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="does not hold an RSA libp2p private key"):
        load_identity(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="does not exist"):
        load_or_create_identity(tmp_path / "missing-dir" / "id.key")


def test_peer_id_matches_libp2p_derivation(tmp_path):
    from hivemind.p2p import PeerID

    identity = generate_identity()
    assert PeerID.from_identity(identity.to_protobuf()).to_base58() == identity.peer_id


def test_a_plan_names_its_signer_which_need_not_be_its_lowest_member(caplog):
    # a leader in standing may plan a lower peer that is not (``leadership.standing``): ``leader_at`` says who
    # signs; the binding holds whoever that is, and travels through the encoding
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.dht.validators")
    members = sorted_membership([ALICE.peer_id, BOB.peer_id, ROGUE.peer_id])
    signer = next(i for i in (ALICE, BOB, ROGUE) if i.peer_id == members[1])
    other = next(i for i in (ALICE, BOB, ROGUE) if i.peer_id == members[0])
    plan = plan_for(members, leader_at=1)
    assert plan.leader == signer.peer_id and PlanRecord.decode(plan.encode()) == plan
    got = verify_entries(RecordKind.PLAN, entries((signer.owner_mark, plan.encode()),
                                                  (other.owner_mark, plan.encode())))
    assert list(got) == [signer.peer_id]  # the lowest member cannot pass it off as its own
    assert f"plan record signed by {other.peer_id} names {signer.peer_id} as leader" in caplog.text
