"""Reading and writing a stream's bytes with as few copies and tasks as asyncio allows.

- ``DirectReader`` reads a stream in place of its ``asyncio.StreamReader``, the socket's bytes going straight
  into the buffer a tensor will use;
- ``BufferPool`` hands out message buffers used again instead of fresh memory;
- ``within`` bounds a wait by a deadline without a task of its own.

Pure asyncio; no libp2p calls. The frames read with them are ``frames``'.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy

T = TypeVar("T")


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
        """Keep ``buffer`` for a later ``take``; the caller must hold no view of it any more. Where it does not
        fit, idle buffers of other sizes make room, the sizes given back longest ago first: a run's messages
        change size (a larger batch, another stage), and the sizes in use now are the ones worth keeping."""
        size = buffer.size
        if not 0 < size <= self.max_bytes:
            return
        with self._lock:
            while self._idle_bytes + size > self.max_bytes:
                other = next((s for s in self._idle if s != size), None)
                if other is None:
                    return  # the room is full of buffers of this size already
                self._idle_bytes -= other * len(self._idle.pop(other))
            self._idle.setdefault(size, []).append(buffer)
            self._idle[size] = self._idle.pop(size)  # the most recent size last: evicted last
            self._idle_bytes += size

    def lend(self, size: int) -> numpy.ndarray:
        """A buffer like ``take``'s that returns to the pool when it is garbage (a tensor made over it with
        ``torch.frombuffer`` keeps it alive as long as the tensor's storage lives)."""
        buffer = self.take(size)
        view = buffer[:]  # the only object that reaches ``buffer``, but for the pool's own reference below
        weakref.finalize(view, self.give_back, buffer).atexit = False
        return view
