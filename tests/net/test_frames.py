"""Hand-made tensor frames (net.frames) against hivemind's own protobuf encoding, and malformed streams."""

from __future__ import annotations

import asyncio
import gc
import socket

import numpy
import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from p2ptrain.net.transport.frames import MAX_PIECE_BYTES, FrameError, Piece, read_pieces, request_frame_head
from p2ptrain.net.transport.streamio import BufferPool, DirectReader, within


def _hivemind_frame(request: runtime_pb2.ExpertRequest) -> bytes:
    body = request.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END_OF_STREAM = P2P.ERROR_MARKER + bytes(P2P.HEADER_LEN)  # hivemind's: an empty RPCError


def _read_all(data: bytes) -> list[Piece]:
    """The pieces of ``data`` read off an asyncio StreamReader, checked to be what a DirectReader that receives
    the same bytes in pieces of any size reads."""
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await _pieces_or_error(reader)

    pieces = asyncio.run(run())
    expected = str(pieces) if isinstance(pieces, FrameError) else pieces
    for chunk_bytes in (1, 7, 4096, 1 << 20):
        assert _read_direct(data, chunk_bytes) == expected, chunk_bytes
    if isinstance(pieces, Exception):
        raise pieces
    return pieces


async def _pieces_or_error(reader) -> list[Piece] | FrameError:
    try:
        return [Piece(p.uid, p.metadata, bytes(p.data), p.buffers) async for p in read_pieces(reader)]
    except FrameError as e:
        return e


class _Socket:
    """The transport side a DirectReader sees: it pauses and resumes reading, nothing else."""

    def __init__(self):
        self.reading = True

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True


def _read_direct(data: bytes, chunk_bytes: int) -> list[Piece] | FrameError:
    """Read ``data`` with a DirectReader whose socket delivers at most ``chunk_bytes`` at a time, as a
    selector transport would: into ``get_buffer``'s buffer, only while reading is not paused."""
    async def deliver(direct: DirectReader, socket: _Socket):
        offset = 0
        while offset < len(data):
            await asyncio.sleep(0)
            if socket.reading:
                buffer = direct.get_buffer(-1)
                n = min(len(buffer), chunk_bytes, len(data) - offset)
                buffer[:n] = data[offset : offset + n]
                offset += n
                direct.buffer_updated(n)
        direct.eof_received()

    async def run():
        socket = _Socket()
        direct = DirectReader(socket, asyncio.Protocol(), limit_bytes=64 << 10)
        feeding = asyncio.create_task(deliver(direct, socket))
        pieces = await _pieces_or_error(direct)
        feeding.cancel()
        return pieces

    result = asyncio.run(run())
    return str(result) if isinstance(result, FrameError) else result


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


def test_a_stream_taken_over_by_a_direct_reader_loses_no_byte_and_still_writes_and_closes():
    """On a real socket: bytes its StreamReader already holds come first, the rest lands in the buffers read
    into; the writer's drain and wait_closed still work (their protocol hears of the connection's end)."""
    sent = bytes(range(256)) * 4096  # 1 MiB

    async def run():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        peer_reader, peer_writer = await asyncio.open_connection(sock=theirs)
        peer_writer.write(sent[:1000])
        await peer_writer.drain()
        assert await reader.readexactly(10) == sent[:10]  # the rest of those 1000 bytes waits in the reader
        direct = await DirectReader.take_over(reader, writer)
        assert isinstance(direct, DirectReader)
        peer_writer.write(sent[1000:])
        received = numpy.empty(len(sent) - 10 - 20, dtype=numpy.uint8)
        head = await direct.readexactly(20)
        await direct.readinto(memoryview(received))
        writer.write(b"answer")
        await writer.drain()
        assert await peer_reader.readexactly(6) == b"answer"
        peer_writer.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await direct.readexactly(1)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)
        return head + received.tobytes()

    assert asyncio.run(run()) == sent[10:]


def test_a_direct_read_cut_off_by_the_end_of_its_stream_raises():
    async def run():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        direct = await DirectReader.take_over(reader, writer)
        theirs.sendall(b"12345")
        theirs.close()
        with pytest.raises(asyncio.IncompleteReadError) as cut:
            await direct.readinto(memoryview(bytearray(10)))
        writer.close()
        return cut.value.partial

    assert asyncio.run(run()) == b"12345"


def test_a_lent_buffer_comes_back_only_when_the_tensor_over_it_is_gone():
    pool = BufferPool(max_bytes=64)
    view = pool.lend(16)
    address = view.ctypes.data
    tensor = torch.frombuffer(view, dtype=torch.float32)
    del view
    gc.collect()
    assert pool.take(16).ctypes.data != address  # the tensor still uses it: a fresh one
    del tensor
    gc.collect()
    assert pool.take(16).ctypes.data == address
    assert pool._idle_bytes == 0
    pool.give_back(numpy.empty(48, dtype=numpy.uint8))
    kept = numpy.empty(32, dtype=numpy.uint8)
    pool.give_back(kept)  # past max_bytes: the other size makes room (the messages' size changed)
    assert pool._idle_bytes == 32 and pool.take(32) is kept and pool._idle_bytes == 0
    for _ in range(3):  # the third finds the room full of its own size: dropped
        pool.give_back(numpy.empty(32, dtype=numpy.uint8))
    pool.give_back(numpy.empty(0, dtype=numpy.uint8))  # nothing to keep
    assert pool._idle_bytes == 64 and set(pool._idle) == {32}


def test_within_bounds_a_wait_and_does_not_start_what_is_already_late():
    started = []

    async def work(delay_s: float) -> str:
        started.append(delay_s)
        await asyncio.sleep(delay_s)
        return "done"

    async def run():
        assert await within(work(0.0), 1.0) == "done"
        with pytest.raises(asyncio.TimeoutError):
            await within(work(10.0), 0.05)
        with pytest.raises(asyncio.TimeoutError):
            await within(work(-1.0), 0.0)

    asyncio.run(run())
    assert started == [0.0, 10.0]
