"""The exact bytes p2ptrain puts on the wire: message headers of every kind, a warm copy's header, refusal
replies, a piece's frame head, the layout of the codecs below int4, and the protocol version a peer record
states. The literals were captured from the code, so a refactoring that changes a
byte (a kind's spelling, a version, a field's order, a refusal code) fails here; a deliberate change of the
protocol updates them, and the version it changes."""

from __future__ import annotations

from concurrent.futures import Future

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2

from p2ptrain.agent.churn.stage_state import send_state, state_shapes
from p2ptrain.agent.churn.warm_copies import BackupSender
from p2ptrain.errors import MessageRejected
from p2ptrain.net.dht.records import PeerRecord
from p2ptrain.net.transport.frames import request_frame_head
from p2ptrain.net.transport.messages import BackupHeader, Header, MessageKind, Refusal, Stamp, Tag
from p2ptrain.net.transport.replies import make_reply, parse_reply
from p2ptrain.net.transport.servicer import refusal
from p2ptrain.runtime.wire import Codec

KINDS = ["activation", "activation_grad", "reduce_shard", "gather_shard", "grad_norm", "probe", "state", "backup",
         "bench", "commit", "sketch", "pipe_commit", "reveal", "evidence"]
CODES = ["refused", "duplicate", "stale", "ahead", "not_sender", "too_slow", "arriving", "busy"]


def test_every_message_kind_and_refusal_code_has_its_bytes_here():
    assert sorted(MessageKind) == sorted(KINDS) and sorted(Refusal) == sorted(CODES)


@pytest.mark.parametrize("kind", KINDS)
def test_a_message_header_of_each_kind_has_its_bytes(kind):
    header = Header(Tag("run-1", 2, 3, MessageKind(kind), 4, 5), "float32", (2, 3))
    assert header.encode() == (b'{"v":1,"run":"run-1","epoch":2,"step":3,"kind":"' + kind.encode()
                               + b'","mb":4,"part":5,"dtype":"float32","shape":[2,3],"nbytes":24}')
    assert Header.decode(header.encode()) == header


def test_a_probe_header_with_its_reply_size_and_arrival_has_its_bytes():
    header = Header(Tag("run-1", 0, 0, "probe"), "uint8", (1024,), 4096, Stamp("boot-a", 12.5))
    assert header.encode() == (b'{"v":1,"run":"run-1","epoch":0,"step":0,"kind":"probe","mb":0,"part":0,'
                               b'"dtype":"uint8","shape":[1024],"nbytes":1024,"reply":4096,"at":["boot-a",12.5]}')


class Recording:
    """A transport that keeps what it is given to send."""

    def __init__(self):
        self.sent: list[tuple[Tag, torch.Tensor]] = []

    def send(self, peer: str, tag: Tag, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.sent.append((tag, tensor.clone()))

    def send_async(self, peer: str, tag: Tag, tensor: torch.Tensor, timeout_s: float | None = None) -> Future:
        self.send(peer, tag, tensor)
        done: Future = Future()
        done.set_result(None)
        return done


def _numbered_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A state of ``module`` with its optimizer's, the elements numbered 0, 1, 2, … in ``state_shapes`` order."""
    tensors, start = {}, 0
    for name, shape in state_shapes(module, with_optimizer=True):
        numel = int(torch.Size(shape).numel())
        tensors[name] = torch.arange(start, start + numel, dtype=torch.float32).reshape(shape)
        start += numel
    return tensors


def test_a_warm_copy_is_a_header_then_its_parts():
    transport = Recording()
    module = torch.nn.Linear(2, 2)
    sender = BackupSender(transport, "run-1", 2, 5.0, part_numel=lambda peer: 3)
    sender.send("peerB", 1, 300, _numbered_state(module), module)
    sender.close(wait_s=10.0)
    (tag, header), *parts = transport.sent
    assert tag.key == "run-1/2/0/backup/1/0" and header.dtype == torch.uint8
    # the training step (8 bytes little-endian), the state's SHA-256, the elements per part (8 bytes little-endian)
    assert header.numpy().tobytes() == (
        b",\x01\x00\x00\x00\x00\x00\x00"
        b"\xe8\xf4\x1b;\xaa{\x95\xcf\xb5^Q\xfd\xf1q;\xfc\xf5\xf9vQ\x1c\x9d\xd8E\x8a\xbdx\xe5I\xba\x02,"
        b"\x03\x00\x00\x00\x00\x00\x00\x00"
    )
    assert Header(tag, "uint8", tuple(header.shape)).encode() == (
        b'{"v":1,"run":"run-1","epoch":2,"step":0,"kind":"backup","mb":1,"part":0,"dtype":"uint8","shape":[48],'
        b'"nbytes":48}'
    )
    assert [t.key for t, _ in parts] == [f"run-1/2/0/backup/1/{part}" for part in range(1, 8)]
    assert torch.equal(torch.cat([p for _, p in parts]), torch.arange(20.0))


def test_a_backup_header_packs_to_its_bytes_and_back():
    header = BackupHeader(step=300, digest=bytes(range(32)), part_numel=3)
    assert header.pack() == b",\x01" + bytes(6) + bytes(range(32)) + b"\x03" + bytes(7)
    assert BackupHeader.unpack(header.pack()) == header and BackupHeader.SIZE_BYTES == 48
    with pytest.raises(ValueError, match="48 bytes"):
        BackupHeader.unpack(header.pack()[:-1])


def test_a_state_hand_over_is_tagged_state():
    transport = Recording()
    module = torch.nn.Linear(2, 2)
    send_state(transport, "peerB", "run-1", 2, 0, _numbered_state(module), module, 5.0, stage=1)
    assert [t.key for t, _ in transport.sent] == ["run-1/2/0/state/1/0"]



@pytest.mark.parametrize("code", CODES)
def test_a_refusal_reply_carries_its_code(code):
    reply = make_reply(error="why", code=Refusal(code))
    body = b'{"error": "why", "code": "' + code.encode() + b'"}'
    assert reply.SerializeToString() == b"\x1a" + bytes([len(body)]) + body
    assert parse_reply(reply).code == code and parse_reply(reply).error == "why"


def test_a_refused_message_is_answered_with_its_code_and_other_errors_with_refused():
    assert refusal("peerA", MessageRejected("dup", peer="peerA", code=Refusal.DUPLICATE)).SerializeToString() == \
        b'\x1a%{"error": "dup", "code": "duplicate"}'
    assert refusal("peerA", ValueError("bad")).SerializeToString() == b'\x1a#{"error": "bad", "code": "refused"}'
    assert make_reply().SerializeToString() == b'\x1a\x0c{"ok": true}'


def test_an_unknown_refusal_code_from_a_peer_reads_as_refused():
    reply = parse_reply(runtime_pb2.ExpertResponse(metadata=b'{"error": "x", "code": "weird"}'))
    assert (reply.error, reply.code) == ("x", "refused")


def test_a_piece_frame_head_has_its_bytes():
    assert request_frame_head(b"run-1/2/3/backup/4/5", b'{"v":1}', 16) == \
        b'\x00\x00\x00\x00\x00\x00\x00\x003\n\x14run-1/2/3/backup/4/5\x1a\x07{"v":1}\x12\x12\n\x10'


def test_a_peer_record_states_protocol_version_5_in_schema_1():
    fields = msgpack.unpackb(PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1).encode())
    assert (fields["v"], fields["protocol_version"]) == (1, 5)


def test_an_int2_message_is_its_steps_then_four_codes_a_byte():
    message = Codec("int2").encode(torch.tensor([-3.0, -1.0, 1.0, 3.0, 3.0]) * 0.5)
    # step 0.5 (float32, little-endian); codes 0, 1, 2, 3 (first in the low bits), then 3 and padding 0
    assert message.numpy().tobytes() == b"\x00\x00\x00?" b"\xe4" b"\x03"


def test_a_topk_message_is_its_scales_then_codes_then_positions():
    x = torch.zeros(260)  # a block of 256 and a tail of 4
    x[torch.tensor([3, 10, 50, 100, 128, 200, 254, 255])] = torch.tensor([-127.0, 1, -2, 3, -4, 5, -6, 7])
    x[256:] = torch.tensor([0.0, -1.0, 2.0, -0.5])
    assert Codec("topk").encode(x).numpy().tobytes() == (
        b"\x00\x00\x80?" b"\x04\x02\x81<"  # scales: 127 / 127 and 2 / 127
        b"\x81\x01\xfe\x03\xfc\x05\xfa\x07" b"\x00\xc0\x7f\xe0"  # int8 codes, the block's 8 then the tail's 4
        b"\x03\n2d\x80\xc8\xfe\xff" b"\x00\x01\x02\x03"  # uint8 positions in increasing order
    )
