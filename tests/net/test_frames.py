"""Hand-made tensor frames (net.frames) against hivemind's own protobuf encoding, and malformed streams."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from p2ptrain.net.frames import MAX_PIECE_BYTES, FrameError, Piece, read_pieces, request_frame_head


def _hivemind_frame(request: runtime_pb2.ExpertRequest) -> bytes:
    body = request.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END_OF_STREAM = P2P.ERROR_MARKER + bytes(P2P.HEADER_LEN)  # hivemind's: an empty RPCError


def _read_all(data: bytes) -> list[Piece]:
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return [piece async for piece in read_pieces(reader)]

    return asyncio.run(run())


@pytest.mark.parametrize(("uid", "metadata", "nbytes"), [
    ("run/0/1/activation/0/0", b'{"v":1}', 1 << 20), ("x", b"", 0), ("y" * 300, b"m" * 5000, 200)])
def test_a_hand_made_frame_is_what_hivemind_would_send(uid, metadata, nbytes):
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    frame = request_frame_head(uid.encode(), metadata, nbytes) + data
    assert frame[:1] == P2P.MESSAGE_MARKER and int.from_bytes(frame[1:9], "big") == len(frame) - 9
    parsed = runtime_pb2.ExpertRequest()
    parsed.ParseFromString(frame[9:])
    assert parsed == runtime_pb2.ExpertRequest(uid=uid, metadata=metadata, tensors=[runtime_pb2.Tensor(buffer=data)])
    assert _read_all(frame) == [Piece(uid, metadata, data)]


def test_frames_serialized_by_hivemind_are_read_alike_whatever_their_field_order_and_extras():
    pieces = [
        runtime_pb2.ExpertRequest(uid="a", metadata=b"h", tensors=[runtime_pb2.Tensor(buffer=b"xyz", dtype="f", size=[3])]),
        runtime_pb2.ExpertRequest(uid="a", tensors=[runtime_pb2.Tensor(buffer=b"")]),
        runtime_pb2.ExpertRequest(uid="a", tensors=[runtime_pb2.Tensor(buffer=b"1"), runtime_pb2.Tensor(buffer=b"2")]),
    ]
    stream = b"".join(map(_hivemind_frame, pieces)) + END_OF_STREAM + b"ignored after the end"
    assert _read_all(stream) == [Piece("a", b"h", b"xyz"), Piece("a", b"", b""), Piece("a", b"", b"2", buffers=2)]


def _head(length: int) -> bytes:
    return P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, "big")


@pytest.mark.parametrize(("stream", "problem"), [
    (request_frame_head(b"a", b"", 10) + bytes(4), "ended in the middle"),
    (b"\x07" + bytes(8), "unknown frame marker"),
    (_head(MAX_PIECE_BYTES + (1 << 20)), "exceeds"),
    (_head(2) + b"\x0d\x00", "wire type 5"),  # field 1 as fixed32
    (_head(3) + b"\x0a\x09ab", "runs past its piece"),  # a 9-byte uid in a 3-byte piece
    (_head(12) + b"\x08" + b"\xff" * 11, "varint longer than 64 bits"),
    (_head(2) + b"\x0a\x01", "runs past its piece"),
    (_head(4) + b"\x0a\x02\xff\xfe", "not UTF-8"),
])
def test_malformed_frames_are_refused(stream, problem):
    with pytest.raises(FrameError, match=problem):
        _read_all(stream)
