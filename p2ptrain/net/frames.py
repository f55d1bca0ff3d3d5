"""Tensor pieces on a hivemind protobuf stream, written and read without building protobuf objects.

hivemind frames each message of a protobuf stream as a marker byte (0 = message, 1 = error or end of
stream), an 8-byte big-endian length and the serialized protobuf. A piece of a tensor message is an
``ExpertRequest{uid, metadata, tensors: [Tensor{buffer}]}`` (servicer.py). Building, serializing and
parsing that protobuf around a megabyte of data copies it four more times than the bytes themselves need
(about 1.5 ms of a 1 MiB message that libp2p moves in ~4 ms on loopback), so both ends handle the frame by
hand and keep the protobuf wire format: the sender writes the few header bytes and then the data straight
from its buffer (``request_frame_head``); the receiver parses the fields as they come and reads the data
as it arrives into the buffer the tensor will use (``read_pieces``). Callers using hivemind's generated stubs interoperate
with both (tests check the encodings agree).

A receiver reads its streams with a ``DirectReader`` (the socket's bytes go straight into that buffer), the
buffers come from a ``BufferPool`` (memory used again, not faulted in afresh), and every wait is bounded by
``within`` (a deadline without a task of its own).

Pure asyncio streams; no libp2p calls.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy

T = TypeVar("T")

MESSAGE_MARKER, ERROR_MARKER = b"\x00", b"\x01"  # hivemind's P2P.MESSAGE_MARKER, P2P.ERROR_MARKER
LENGTH_BYTES = 8  # hivemind's P2P.HEADER_LEN, big-endian
MAX_PIECE_BYTES = 4 << 20  # a piece's data (libp2p messages cap at 4 MiB; senders' chunks are at most 3 MiB)
MAX_FIELD_BYTES = 64 << 10  # any other field of a piece (tag keys, headers: far smaller)
MAX_FIELDS = 64

# protobuf wire types
VARINT, LENGTH_DELIMITED = 0, 2
# field numbers of hivemind's runtime.proto
REQUEST_UID, REQUEST_TENSORS, REQUEST_METADATA = 1, 2, 3
TENSOR_BUFFER = 1


if sys.version_info >= (3, 11):
    async def within(awaitable: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``asyncio.wait_for`` without its task: the deadline cancels the awaiting task itself. A wait per piece
        and per message, each one more task and loop pass, was a tenth of a message's cost on the loop. As
        with ``wait_for``, a deadline already passed does not start the coroutine."""
        if timeout_s <= 0:
            awaitable.close()
            raise asyncio.TimeoutError
        async with asyncio.timeout(timeout_s):
            return await awaitable
else:  # pragma: no cover - Python 3.10 has no asyncio.timeout
    within = asyncio.wait_for


class FrameError(ValueError):
    """A stream that is not a sequence of well-formed pieces."""


@dataclass(frozen=True)
class Piece:
    """One piece of a tensor message: the tag key, the header (first piece only, else empty), the bytes."""

    uid: str
    metadata: bytes
    data: bytes | bytearray | numpy.ndarray  # read off a stream here: writable (uint8), the receiver may keep it
    buffers: int = 1  # how many tensor buffers the frame carried (a piece carries exactly one)


def request_frame_head(uid: bytes, metadata: bytes, nbytes: int) -> bytes:
    """Everything of one piece's frame but its ``nbytes`` of data, which the caller writes right after.

    The buffer field goes last so that the data can follow the head without being copied into it."""
    tensor = _key(TENSOR_BUFFER) + _varint(nbytes)
    body = (_key(REQUEST_UID) + _varint(len(uid)) + uid
            + (_key(REQUEST_METADATA) + _varint(len(metadata)) + metadata if metadata else b"")
            + _key(REQUEST_TENSORS) + _varint(len(tensor) + nbytes) + tensor)
    return MESSAGE_MARKER + (len(body) + nbytes).to_bytes(LENGTH_BYTES, "big") + body


def message_frame(body: bytes) -> bytes:
    """A whole frame of a serialized protobuf (a reply), to be written at once: hivemind's ``send_protobuf``
    writes marker, length and body separately, and each write can reach the peer as a packet of its own
    that wakes its reader."""
    return MESSAGE_MARKER + len(body).to_bytes(LENGTH_BYTES, "big") + body


Allocate = Callable[[int], "bytearray | numpy.ndarray"]  # a writable buffer of that many bytes


async def read_pieces(reader: asyncio.StreamReader | DirectReader, allocate: Allocate = bytearray) -> AsyncIterator[Piece]:
    """The pieces of an incoming stream until its end (an end-of-stream frame, or the stream closing between
    two frames), each piece's data in a buffer from ``allocate``. FrameError for anything else; the caller's
    deadlines bound every wait."""
    while True:
        try:
            marker = await reader.readexactly(1)
        except asyncio.IncompleteReadError:
            return
        try:
            length = int.from_bytes(await reader.readexactly(LENGTH_BYTES), "big")
            if marker == ERROR_MARKER:  # hivemind ends a stream with an empty error frame
                await _skip(reader, min(length, MAX_FIELD_BYTES))
                return
            if marker != MESSAGE_MARKER:
                raise FrameError(f"unknown frame marker {marker!r}")
            if length > MAX_PIECE_BYTES + MAX_FIELD_BYTES:
                raise FrameError(f"a piece of {length} bytes exceeds {MAX_PIECE_BYTES + MAX_FIELD_BYTES}")
            yield await _read_request(_Fields(reader, length, allocate))
        except asyncio.IncompleteReadError:
            raise FrameError("the stream ended in the middle of a piece") from None


async def _read_request(fields: _Fields) -> Piece:
    uid, metadata, data, buffers = b"", b"", b"", 0
    while fields.left:
        number, wire, size = await fields.next()
        if number == REQUEST_UID and wire == LENGTH_DELIMITED:
            uid = await fields.read(size, MAX_FIELD_BYTES)
        elif number == REQUEST_METADATA and wire == LENGTH_DELIMITED:
            metadata = await fields.read(size, MAX_FIELD_BYTES)
        elif number == REQUEST_TENSORS and wire == LENGTH_DELIMITED:
            buffers += 1
            data = await _read_tensor(fields, size)
        else:
            await fields.skip(wire, size)
    try:
        return Piece(uid.decode(), metadata, data, buffers)
    except UnicodeDecodeError:
        raise FrameError("a piece's tag key is not UTF-8") from None


async def _read_tensor(outer: _Fields, length: int) -> bytes:
    """A Tensor sub-message of ``length`` bytes: its buffer (other fields are read and ignored)."""
    if length > outer.left:
        raise FrameError("a tensor field runs past its piece")
    fields = _Fields(outer.reader, length, outer.allocate)
    outer.left -= length
    data = b""
    while fields.left:
        number, wire, size = await fields.next()
        if number == TENSOR_BUFFER and wire == LENGTH_DELIMITED:
            data = await fields.read_data(size)
        else:
            await fields.skip(wire, size)
    return data


class _Fields:
    """Reads the fields of one protobuf message of known length off a stream."""

    def __init__(self, reader: asyncio.StreamReader | DirectReader, length: int, allocate: Allocate = bytearray):
        self.reader = reader
        self.allocate = allocate
        self.left = length
        self._count = 0

    async def next(self) -> tuple[int, int, int]:
        """(field number, wire type, length or varint value) of the next field."""
        self._count += 1
        if self._count > MAX_FIELDS:
            raise FrameError(f"a piece has more than {MAX_FIELDS} fields")
        key = await self._varint()
        number, wire = key >> 3, key & 7
        if wire not in (VARINT, LENGTH_DELIMITED):
            raise FrameError(f"field {number} has wire type {wire}, which pieces never use")
        return number, wire, await self._varint()

    async def read(self, size: int, limit: int) -> bytes:
        if size > self.left or size > limit:
            raise FrameError(f"a field of {size} bytes runs past its piece or exceeds {limit}")
        self.left -= size
        return await self.reader.readexactly(size)

    async def read_data(self, size: int) -> bytearray | numpy.ndarray:
        """A tensor buffer, read as it arrives: ``readexactly`` of a megabyte would let the stream's buffer
        grow past its limit, pause reading after every few hundred kilobytes and stall the sender's daemon.
        A ``DirectReader`` receives it straight into the buffer."""
        if size > self.left or size > MAX_PIECE_BYTES:
            raise FrameError(f"a buffer of {size} bytes runs past its piece or exceeds {MAX_PIECE_BYTES}")
        self.left -= size
        data = self.allocate(size)
        if isinstance(self.reader, DirectReader):
            await self.reader.readinto(memoryview(data))
            return data
        view, filled = memoryview(data), 0
        while filled < size:
            chunk = await self.reader.read(size - filled)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(view[:filled]), size)
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return data

    async def skip(self, wire: int, size: int) -> None:
        if wire == LENGTH_DELIMITED:
            if size > self.left or size > MAX_FIELD_BYTES:
                raise FrameError(f"an unknown field of {size} bytes runs past its piece or exceeds {MAX_FIELD_BYTES}")
            self.left -= size
            await _skip(self.reader, size)

    async def _varint(self) -> int:
        value = 0
        for shift in range(0, 64, 7):
            if self.left <= 0:
                raise FrameError("a field runs past its piece")
            byte = (await self.reader.readexactly(1))[0]
            self.left -= 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
        raise FrameError("a varint longer than 64 bits")


async def _skip(reader: asyncio.StreamReader, size: int) -> None:
    await reader.readexactly(size)


def _key(number: int) -> bytes:
    return bytes([number << 3 | LENGTH_DELIMITED])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


class DirectReader(asyncio.BufferedProtocol):
    """Reads a stream in place of its ``asyncio.StreamReader``: ``readexactly`` as that has it, and ``readinto``,
    which receives the socket's bytes straight into the caller's buffer. One copy, the kernel's, where a
    StreamReader makes three (into a bytes object, into its buffer, out again) and pauses the socket every
    128 KiB; on loopback that was a third of the receiver's CPU time per 1 MiB message. Installed on a live
    stream by ``take_over``; write flow control and the connection's end are passed on to the stream's own
    protocol, which its StreamWriter still uses. All methods run on the stream's event loop; one reader."""

    def __init__(self, transport: asyncio.Transport, protocol: asyncio.BaseProtocol, limit_bytes: int = 256 << 10):
        self._transport = transport
        self._protocol = protocol  # the StreamReaderProtocol, for drain() and wait_closed()
        self._limit_bytes = limit_bytes
        self._buffer = bytearray()  # received, not yet read
        self._scratch = memoryview(bytearray(limit_bytes))
        self._target: memoryview | None = None  # the rest of a readinto, while it waits: filled in place
        self._filled = 0
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._paused = False

    @classmethod
    async def take_over(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> DirectReader | asyncio.StreamReader:
        """Read the stream of (``reader``, ``writer``) with a DirectReader from now on (what ``reader`` holds
        already comes first); ``reader`` itself where the transport cannot be taken over."""
        transport = writer.transport
        if transport.is_closing() or not hasattr(transport, "set_protocol") or reader.exception() is not None:
            return reader
        direct = cls(transport, transport.get_protocol())
        transport.set_protocol(direct)
        reader.feed_eof()  # nothing more reaches it: read what it holds without waiting
        direct._buffer += await reader.read()
        if not transport.is_reading():  # the StreamReader had paused it
            transport.resume_reading()
        return direct

    # --- the protocol --------------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled :]  # never empty: a full target is dropped at once
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None
                self._wake()
            return
        self._buffer += self._scratch[:nbytes]
        if len(self._buffer) > self._limit_bytes and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the transport open for our replies, as StreamReaderProtocol does

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()
        self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()

    # --- reading -------------------------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes; IncompleteReadError if the stream ends first (as StreamReader's)."""
        while len(self._buffer) < n:
            if self._eof:
                partial = bytes(self._buffer)
                self._buffer.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        data = bytes(self._buffer[:n])
        self._consume(n)
        return data

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view`` from the stream; IncompleteReadError if it ends first. Cancelled midway, the bytes
        that reached ``view`` are lost to the stream (a message cut off midway ends its stream anyway)."""
        n = min(len(self._buffer), len(view))
        with memoryview(self._buffer) as buffered:
            view[:n] = buffered[:n]
        self._consume(n)
        if n == len(view):
            return
        self._target, self._filled = view[n:], 0
        try:
            while self._target is not None:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(view[: n + self._filled]), len(view))
                await self._wait()
        finally:
            self._target = None

    def _consume(self, n: int) -> None:
        del self._buffer[:n]
        if self._paused and len(self._buffer) <= self._limit_bytes // 2:
            self._resume()

    def _resume(self) -> None:
        self._paused = False
        self._transport.resume_reading()

    async def _wait(self) -> None:
        assert self._waiter is None, "one reader at a time"
        if self._paused:  # the reader needs more than is buffered
            self._resume()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class BufferPool:
    """Message buffers used again instead of fresh memory: with eight 1 MiB messages in flight, the allocator
    handed each buffer's pages back to the system once it was freed, and faulting them in again on both ends
    cost about as much as moving the bytes (measured: ~350 page faults per message, 0.3 ms).

    ``take`` gives a buffer back explicitly (``give_back``: the sender's copies, once no stream can hold a view
    of them); ``lend`` gives a view that comes back by itself when the last reference to it (a received
    tensor's storage) is gone. Holds at most ``max_bytes`` idle; thread-safe (buffers come back from any
    thread)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._idle: dict[int, list[numpy.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> numpy.ndarray:
        """A uint8 buffer of ``size`` bytes, its content undefined."""
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                self._idle_bytes -= size
                return idle.pop()
        return numpy.empty(size, dtype=numpy.uint8)

    def give_back(self, buffer: numpy.ndarray) -> None:
        """Keep ``buffer`` for a later ``take``; the caller must hold no view of it any more."""
        with self._lock:
            if self._idle_bytes + buffer.size <= self.max_bytes:
                self._idle.setdefault(buffer.size, []).append(buffer)
                self._idle_bytes += buffer.size

    def lend(self, size: int) -> numpy.ndarray:
        """A buffer like ``take``'s that returns to the pool when it is garbage (a tensor made over it with
        ``torch.frombuffer`` keeps it alive as long as the tensor's storage lives)."""
        buffer = self.take(size)
        view = buffer[:]  # the only object that reaches ``buffer``, but for the pool's own reference below
        weakref.finalize(view, self.give_back, buffer).atexit = False
        return view
