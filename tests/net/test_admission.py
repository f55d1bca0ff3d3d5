"""Closed runs: join tokens, the admission policy, and where it is enforced (DHT nodes, readers, mailbox)."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from p2ptrain.errors import ConfigError, MessageRejected
from p2ptrain.net.dht.admission import (
    AdmissionConfig,
    AdmissionPolicy,
    TokenError,
    attach_token,
    decode_token,
    make_token,
    parse_token_text,
    token_of,
)
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.records import ProgressRecord
from p2ptrain.net.dht.validators import SwarmRecordValidator, verify_entries
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.mailbox import Mailbox
from p2ptrain.net.transport.messages import Header, Tag

ORGANISER, VOLUNTEER, LISTED, STRANGER = (generate_identity() for _ in range(4))
CLOSED = AdmissionConfig(peers=(LISTED.peer_id,), organiser=ORGANISER.peer_id)
VALUE = ProgressRecord(1, 2, 3.0, 0.5).encode()


def token_for(identity, run: str = "demo", valid_s: float | None = None, now: float | None = None) -> bytes:
    return parse_token_text(make_token(ORGANISER.private_key, run, identity.peer_id, valid_s, now).to_text())


def test_a_token_round_trips_through_its_text_and_names_the_organiser():
    raw = token_for(VOLUNTEER)
    token = decode_token(raw)
    assert (token.run, token.peer_id, token.organiser) == ("demo", VOLUNTEER.peer_id, ORGANISER.peer_id)
    text = make_token(ORGANISER.private_key, "demo", VOLUNTEER.peer_id).to_text()
    assert decode_token(AdmissionConfig(organiser=ORGANISER.peer_id, token=text).token_bytes()).peer_id == token.peer_id


def test_open_runs_admit_everyone():
    policy = AdmissionPolicy("demo", AdmissionConfig())
    assert not policy.closed and policy.refusal(STRANGER.peer_id, None) is None


@pytest.mark.parametrize("who, token, admitted", [
    ("listed", None, True),
    ("organiser", None, True),
    ("volunteer", "own", True),
    ("stranger", None, False),
    ("stranger", "volunteer's", False),  # a stolen token admits only its holder's peer ID
    ("volunteer", "other run", False),
    ("volunteer", "other organiser", False),
    ("volunteer", "expired", False),
    ("volunteer", "garbage", False),
])
def test_closed_runs_admit_listed_peers_and_holders_of_their_own_valid_token(who, token, admitted):
    identity = {"listed": LISTED, "organiser": ORGANISER, "volunteer": VOLUNTEER, "stranger": STRANGER}[who]
    other = generate_identity()
    raw = {
        None: None, "own": token_for(VOLUNTEER), "volunteer's": token_for(VOLUNTEER),
        "other run": token_for(VOLUNTEER, run="other"), "garbage": b"\x93\x01\x02\x03",
        "other organiser": parse_token_text(make_token(other.private_key, "demo", VOLUNTEER.peer_id).to_text()),
        "expired": token_for(VOLUNTEER, valid_s=60.0, now=get_dht_time() - 86400.0),
    }[token]
    refusal = AdmissionPolicy("demo", CLOSED).refusal(identity.peer_id, raw)
    assert (refusal is None) == admitted, refusal


def test_a_tampered_token_is_not_a_token():
    raw = bytearray(token_for(VOLUNTEER))
    raw[-20] ^= 1
    with pytest.raises(TokenError):
        decode_token(bytes(raw))
    with pytest.raises(ConfigError, match="admission.token"):
        AdmissionConfig(token="p2ptrain-join-1.AAAA")


def dht_record(identity, value: bytes) -> DHTRecord:
    return DHTRecord(key=DHTID.generate(source="demo.progress").to_bytes(),
                     subkey=MSGPackSerializer.dumps(identity.owner_mark), value=MSGPackSerializer.dumps(value),
                     expiration_time=get_dht_time() + 60)


def test_dht_nodes_of_a_closed_run_refuse_entries_of_peers_it_does_not_admit(caplog):
    policies = {"demo": AdmissionPolicy("demo", CLOSED)}
    validator = SwarmRecordValidator(["demo"], policies)
    assert validator.validate(dht_record(LISTED, VALUE))
    assert validator.validate(dht_record(VOLUNTEER, attach_token(VALUE, token_for(VOLUNTEER))))
    assert not validator.validate(dht_record(STRANGER, VALUE))
    assert not validator.validate(dht_record(STRANGER, attach_token(VALUE, token_for(VOLUNTEER))))
    assert "not admitted" in caplog.text
    assert SwarmRecordValidator(["demo"]).validate(dht_record(STRANGER, VALUE))  # an open run


def test_readers_skip_records_of_peers_not_admitted_and_decode_the_others_with_their_token():
    entries = {
        identity.owner_mark: ValueWithExpiration(value, get_dht_time() + 60)
        for identity, value in ((LISTED, VALUE), (VOLUNTEER, attach_token(VALUE, token_for(VOLUNTEER))),
                                (STRANGER, VALUE))
    }
    verified = verify_entries(RecordKind.PROGRESS, entries, policy=AdmissionPolicy("demo", CLOSED))
    assert set(verified) == {LISTED.peer_id, VOLUNTEER.peer_id}
    assert verified[VOLUNTEER.peer_id].record == ProgressRecord(1, 2, 3.0, 0.5)
    assert token_of(VALUE) is None and set(verify_entries(RecordKind.PROGRESS, entries)) == {
        LISTED.peer_id, VOLUNTEER.peer_id, STRANGER.peer_id}


def test_the_mailbox_refuses_tensors_of_senders_not_admitted_at_the_header():
    mailbox = Mailbox("demo", max_message_bytes=1 << 20, max_buffered_bytes=1 << 20, step_window=2, epoch_window=1)
    mailbox.admit_sender = lambda peer: peer == LISTED.peer_id
    header = Header(Tag("demo", 0, 0, "activation", micro_batch=0), "float32", (4,))
    mailbox.abandon(mailbox.admit(LISTED.peer_id, header))
    with pytest.raises(MessageRejected, match="not admitted"):
        mailbox.admit(STRANGER.peer_id, header)
    assert mailbox.held_bytes == 0
