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

A receiver reads its streams with a ``streamio.DirectReader`` (the socket's bytes go straight into that
buffer), and the buffers come from a ``streamio.BufferPool``.

Pure asyncio streams; no libp2p calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy

from p2ptrain.net.transport.streamio import DirectReader

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


class Landing:
    """An ``Allocate`` that can be aimed: the next buffer asked for that fits lands in the place aimed at (the
    rest of a message's buffer, ``servicer.read_payload``), so a message of many pieces is read into its own
    buffer and not copied there piece by piece; otherwise a buffer from ``allocate``."""

    def __init__(self, allocate: Allocate):
        self.allocate = allocate
        self._aim: memoryview | None = None
        self.landed: memoryview | None = None  # the last buffer handed out in place, until the next aim

    def aim(self, view: memoryview | None) -> None:
        """The place the next buffer that fits lands in (None: wherever ``allocate`` says)."""
        self._aim, self.landed = view, None

    def __call__(self, size: int):
        aim, self._aim = self._aim, None
        if aim is not None and size <= len(aim):
            self.landed = aim[:size]
            return self.landed
        return self.allocate(size)


class Landed:
    """``read_pieces(reader, landing)`` with its ``landing`` at hand (``servicer.Pieces`` aims it)."""

    def __init__(self, read, reader, landing: Landing):
        self._pieces, self.landing = read(reader, landing), landing

    def __aiter__(self) -> Landed:
        return self

    async def __anext__(self) -> Piece:
        return await self._pieces.__anext__()


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
        A ``DirectReader`` (or a direct connection's ``SealedReader``) receives it straight into the buffer."""
        if size > self.left or size > MAX_PIECE_BYTES:
            raise FrameError(f"a buffer of {size} bytes runs past its piece or exceeds {MAX_PIECE_BYTES}")
        self.left -= size
        data = self.allocate(size)
        if hasattr(self.reader, "readinto"):
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
