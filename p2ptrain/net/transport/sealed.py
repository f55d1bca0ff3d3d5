"""A direct connection's bytes, sealed, moved by threads of its own: the bulk path of the direct data plane.

An asyncio transport moved a direct connection's tensors at a fifth of what the socket carries: each piece's
ciphertext was a fresh allocation, what the kernel did not take at once was copied into the transport's
buffer (and moved down in it after every send), and every few hundred kilobytes cost a pass of the event
loop on each end. Here a proven connection's socket is blocking and has two threads:

- the **writer** seals what the event loop hands it (``write``: a view, not a copy) in records of
  ``RECORD_BYTES`` into one buffer used again, and sends each record with one ``sendall``;
- the **reader** serves the event loop's reads (``readexactly``, ``readinto``) one request at a time: a record
  arrives whole with one ``recv_into`` (``MSG_WAITALL``) into a buffer used again, and opens straight into the
  caller's buffer where it fits (a piece's data), or into a small buffer of plain bytes (frame heads).

The kernel's copies and AES-GCM are all that touch the bytes; the threads release the interpreter while they
wait on the socket, so a sender seals the next record while the kernel moves the last.

Records: ``[4-byte length][ciphertext + 16-byte tag]``, at most ``MAX_RECORD_BYTES`` of plaintext, nonces the
record's number in its direction (keys are per connection and direction: no key and nonce pair repeats). A
record that does not open raises ``Refused`` on the reader; the connection is then cut.

The event loop's side follows asyncio's streams: ``write``/``drain``/``close`` (``drain`` waits while more than
``WRITE_BUFFER_BYTES`` are queued), ``readexactly`` raising IncompleteReadError at the end of the stream. A read
cancelled midway (its deadline passed) cuts the connection, as a message cut off midway ends its stream; so do
``abort`` and any socket error. Threads end with their connection; the socket closes when both have ended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import threading
import time

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

TAG_BYTES = 16
RECORD_BYTES = 256 << 10  # a sealed record's plaintext as the writer makes them: it stays in the core's cache
MAX_RECORD_BYTES = 1 << 20  # the most a reader takes in one record
SMALL_BYTES = 64 << 10  # writes up to this size queued together travel in one record
WRITE_BUFFER_BYTES = 16 << 20  # queued for the writer thread before ``drain`` waits
_LENGTH = struct.Struct(">I")


class Refused(ConnectionError):
    """A direct connection that does not follow the agreement (unknown session, a proof or record that does not
    open)."""


def nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "big")


def seal_record(key: AESGCM, counter: int, plain: bytes | memoryview) -> bytes:
    """One record as it goes on the wire (the handshake's proof; the writer thread seals in place)."""
    return _LENGTH.pack(len(plain) + TAG_BYTES) + key.encrypt(nonce(counter), bytes(plain), None)


def read_record(sock: socket.socket, key: AESGCM, counter: int, limit: int, deadline: float) -> bytes:
    """The next record of ``sock``, opened, by ``deadline`` (``time.monotonic``): Refused if it does not open,
    TimeoutError or ConnectionError if it does not arrive (the handshake's proofs)."""
    (n,) = _LENGTH.unpack(recv_exactly(sock, _LENGTH.size, deadline))
    if not TAG_BYTES <= n <= limit + TAG_BYTES:
        raise Refused(f"a record of {n} bytes")
    try:
        return key.decrypt(nonce(counter), recv_exactly(sock, n, deadline), None)
    except Exception as e:  # cryptography's InvalidTag
        raise Refused(f"a record that does not open ({type(e).__name__})") from None


def recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes of ``sock`` by ``deadline``; TimeoutError past it, ConnectionResetError if the stream ends."""
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake's deadline passed")
        sock.settimeout(left)
        received = sock.recv_into(view[got:], n - got)
        if received == 0:
            raise ConnectionResetError("the connection ended")
        got += received
    return bytes(data)


def _recv_into(connection: SealedConnection, view: memoryview) -> None:
    """Fill ``view`` from a connection's blocking socket: one system call for a whole record as a rule. A cut
    connection stops at once (after ``shutdown`` Linux still hands over what keeps arriving)."""
    got = 0
    while got < len(view):
        n = connection.sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0 or connection.aborted:
            raise ConnectionResetError("the connection ended" if n == 0 else "the direct connection was cut")
        got += n


class SealedConnection:
    """One proven direct connection (a blocking socket and both directions' keys) served by a writer and a
    reader thread; ``reader`` and ``writer`` are its faces on the event loop ``loop``. See the module docstring.
    ``counters``: the records each direction already carried (the handshake's proofs)."""

    def __init__(self, sock: socket.socket, outbound: AESGCM, inbound: AESGCM, loop: asyncio.AbstractEventLoop,
                 name: str, counters: tuple[int, int] = (1, 1)):
        sock.settimeout(None)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.loop, self.name = sock, loop, name
        self._lock = threading.Lock()
        self._threads_left = 2
        self._on_end: list = []
        self.aborted = False
        self.writer = SealedWriter(self, outbound, counters[0])
        self.reader = SealedReader(self, inbound, counters[1])
        self.writer.start()
        self.reader.start()

    def abort(self) -> None:
        """Cut the connection at once (both threads end; pending reads and drains fail). Any thread."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.writer.wake()
        self.reader.wake()

    def close(self) -> None:
        """Send what is queued, then end the connection (the reader takes no more requests). Any thread."""
        self.writer.close()
        self.reader.stop()

    def on_end(self, callback) -> None:
        """``callback(self)`` once both threads have ended and the socket is closed (on the last thread)."""
        with self._lock:
            if self._threads_left:
                self._on_end.append(callback)
                return
        callback(self)

    def thread_ended(self) -> None:
        with self._lock:
            self._threads_left -= 1
            last = self._threads_left == 0
            callbacks, self._on_end = (self._on_end, []) if last else ([], self._on_end)
        if last:
            with contextlib.suppress(OSError):
                self.sock.close()
            for callback in callbacks:
                callback(self)

    def call_soon(self, callback, *args) -> None:
        """``callback(*args)`` on the event loop, from a thread; nothing once the loop has closed."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SealedWriter:
    """The writing face of a ``SealedConnection`` (``write``, ``drain``, ``close`` as a StreamWriter's): writes
    are queued as views, sealed and sent by the writer thread. The caller keeps a written buffer unchanged until
    the message it belongs to is answered (the transport's buffers are given back only then)."""

    def __init__(self, connection: SealedConnection, key: AESGCM, counter: int):
        self._connection, self._key, self._counter = connection, key, counter
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # a drain waiting for the queue to shrink
        self._closed = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=f"p2ptrain-sealed-write-{connection.name}", daemon=True)
        self.sent_bytes = 0

    def start(self) -> None:
        self._thread.start()

    # --- the event loop's side -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None or self._closing:
            raise ConnectionResetError(f"the direct connection is closed ({self._error!r})")
        view = memoryview(data).cast("B")
        if not len(view):
            return
        with self._cond:
            self._queue.append(view)
            self._queued += len(view)
            self._cond.notify()

    async def drain(self) -> None:
        while True:
            if self._error is not None:
                raise ConnectionResetError(f"the direct connection broke: {self._error!r}")
            if self._queued <= WRITE_BUFFER_BYTES:
                return
            self._waiter = self._connection.loop.create_future()
            try:
                if self._queued > WRITE_BUFFER_BYTES and self._error is None:  # the thread may have moved on
                    await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Send what is queued, then end our direction of the stream. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def is_closing(self) -> bool:
        return self._closing or self._error is not None

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def abort(self) -> None:
        self._connection.abort()

    # --- the writer thread ----------------------------------------------------------------------------------

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        out = memoryview(bytearray(_LENGTH.size + RECORD_BYTES + TAG_BYTES))
        error: BaseException | None = None
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closing and not self._connection.aborted:
                        self._cond.wait()
                    if self._connection.aborted:
                        raise ConnectionResetError("the direct connection was cut")
                    if not self._queue:  # closing, everything sent
                        break
                    view = self._queue.popleft()
                    if len(view) <= SMALL_BYTES:  # frame heads and replies: one record with what follows them
                        parts = [view]
                        while self._queue and sum(map(len, parts)) + len(self._queue[0]) <= SMALL_BYTES:
                            parts.append(self._queue.popleft())
                        view = memoryview(b"".join(parts)) if len(parts) > 1 else view
                        taken = sum(map(len, parts))
                    else:
                        taken = len(view)
                self._send(view, out)
                self._sent(taken)
            with contextlib.suppress(OSError):
                self._connection.sock.shutdown(socket.SHUT_WR)
        except (OSError, ValueError) as e:  # the peer went away, or we cut the connection
            error = e
        except BaseException as e:  # noqa: BLE001 - a bug: the connection must still end
            logger.warning("direct connection %s: the writer failed", self._connection.name, exc_info=True)
            error = e
        finally:
            self._finish(error)

    def _send(self, view: memoryview, out: memoryview) -> None:
        sock = self._connection.sock
        for start in range(0, len(view), RECORD_BYTES):
            part = view[start: start + RECORD_BYTES]
            self._counter += 1
            end = _LENGTH.size + len(part) + TAG_BYTES
            _LENGTH.pack_into(out, 0, len(part) + TAG_BYTES)
            self._key.encrypt_into(nonce(self._counter), part, None, out[_LENGTH.size: end])
            if self._connection.aborted:
                raise ConnectionResetError("the direct connection was cut")
            sock.sendall(out[:end])

    def _sent(self, n: int) -> None:
        with self._cond:
            self._queued -= n
            self.sent_bytes += n
        if self._waiter is not None and self._queued <= WRITE_BUFFER_BYTES:
            self._connection.call_soon(self._wake_drain)

    def _wake_drain(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter, None)

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._error = error or ConnectionResetError("the direct connection is closed")
            self._queue.clear()
            self._queued = 0
        if error is not None:
            self._connection.abort()
        self._connection.call_soon(self._closed_on_loop)
        self._connection.thread_ended()

    def _closed_on_loop(self) -> None:
        self._closed.set()
        self._wake_drain()


class SealedReader:
    """The reading face of a ``SealedConnection`` (``readexactly``, ``readinto``, as ``streamio.DirectReader``'s).
    A read the bytes already opened cannot answer is one request to the reader thread, which receives and
    opens whole records. Between requests the thread reads ahead: the next record's length, and the record
    itself if it is small (a piece's head, a reply), so the next head is usually opened before the event loop
    asks for it; a large record waits for the buffer it opens into. One reader at a time; a read cancelled
    midway cuts the connection."""

    def __init__(self, connection: SealedConnection, key: AESGCM, counter: int):
        self._connection, self._key, self._counter = connection, key, counter
        self._cond = threading.Condition()  # guards everything below that both sides touch
        self._plain = bytearray()  # opened, not yet read
        self._request: tuple[memoryview | int, asyncio.Future] | None = None
        self._ahead = False  # the thread may read the next record ahead
        self._next_size: int | None = None  # a record whose length the thread read, its body not yet
        self._failure: BaseException | None = None  # what ended the stream for the reader
        self._stopping = False  # no more requests: the thread ends when it has none
        self._thread = threading.Thread(target=self._run, name=f"p2ptrain-sealed-read-{connection.name}", daemon=True)
        self.received_bytes = 0

    def start(self) -> None:
        self._thread.start()

    # --- the event loop's side -----------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes:
        with self._cond:
            enough = len(self._plain) >= n
        if not enough:
            await self._ask(n)
        with self._cond:
            data = bytes(self._plain[:n])
            del self._plain[:n]
        return data

    async def readinto(self, view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" else view
        with self._cond:
            n = min(len(self._plain), len(view))
            view[:n] = self._plain[:n]
            del self._plain[:n]
        if n < len(view):
            await self._ask(view[n:])

    async def _ask(self, what: memoryview | int) -> None:
        """Have the thread fill ``what`` (a view), or the opened bytes up to ``what``."""
        future = self._connection.loop.create_future()
        with self._cond:
            if self._failure is not None or self._connection.aborted:
                raise _read_error(self._failure, what)
            self._request = (what, future)
            self._cond.notify()
        try:
            await future
        except asyncio.CancelledError:
            self._connection.abort()  # the thread may be filling ``what``: the stream cannot go on
            raise

    # --- the reader thread ----------------------------------------------------------------------------------

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _run(self) -> None:
        sealed = memoryview(bytearray(MAX_RECORD_BYTES + TAG_BYTES))
        try:
            while True:
                with self._cond:
                    while self._request is None and not self._connection.aborted and not self._stopping \
                            and not self._ahead:
                        self._cond.wait()
                    if self._connection.aborted or (self._request is None and self._stopping):
                        return  # a request left waiting is failed on the way out
                    request, self._request = self._request, None
                    self._ahead = request is not None
                try:
                    if request is None:
                        self._read_ahead(sealed)
                    elif isinstance(request[0], int):
                        self._fill_plain(request[0], sealed)
                    else:
                        self._fill(request[0], sealed)
                except (OSError, ValueError) as e:  # the stream ended or broke, a record that does not open
                    with self._cond:
                        self._failure = e
                    if not isinstance(e, ConnectionResetError):  # anything but the stream's end cuts it
                        self._connection.abort()
                    if request is not None:
                        self._connection.call_soon(_settle, request[1], _read_error(e, request[0]))
                    return
                if request is not None:
                    self._connection.call_soon(_settle, request[1], None)
        except BaseException:  # noqa: BLE001 - a bug: the connection must still end
            logger.warning("direct connection %s: the reader failed", self._connection.name, exc_info=True)
            self._connection.abort()
        finally:
            with self._cond:
                self._failure = self._failure or ConnectionResetError("the direct connection is closed")
                pending, self._request = self._request, None
            if pending is not None:
                self._connection.call_soon(_settle, pending[1], _read_error(self._failure, pending[0]))
            self._connection.thread_ended()

    def _read_ahead(self, sealed: memoryview) -> None:
        size = self._next_length()
        if size > SMALL_BYTES:  # it opens into the buffer of the read that asks for it
            self._next_size = size
            return
        plain = self._open_sized(size, sealed, None)
        with self._cond:
            self._plain += plain

    def _fill_plain(self, n: int, sealed: memoryview) -> None:
        while True:
            with self._cond:
                if len(self._plain) >= n:
                    return
            plain = self._open_sized(self._next_length(), sealed, None)
            with self._cond:
                self._plain += plain

    def _fill(self, view: memoryview, sealed: memoryview) -> None:
        with self._cond:  # what was read ahead since the caller looked comes first
            filled = min(len(self._plain), len(view))
            view[:filled] = self._plain[:filled]
            del self._plain[:filled]
        while filled < len(view):
            size = self._next_length()
            if size <= len(view) - filled:  # the record opens straight into the caller's buffer
                self._open_sized(size, sealed, view[filled: filled + size])
                filled += size
            else:
                plain = self._open_sized(size, sealed, None)
                take = len(view) - filled
                view[filled:] = plain[:take]
                with self._cond:
                    self._plain += plain[take:]
                filled += take

    def _next_length(self) -> int:
        if self._next_size is not None:
            size, self._next_size = self._next_size, None
            return size
        head = bytearray(_LENGTH.size)
        _recv_into(self._connection, memoryview(head))
        (n,) = _LENGTH.unpack(head)
        if not TAG_BYTES <= n <= MAX_RECORD_BYTES + TAG_BYTES:
            raise Refused(f"a record of {n} bytes")
        return n - TAG_BYTES

    def _open_sized(self, size: int, sealed: memoryview, out: memoryview | None) -> bytes | None:
        record = sealed[: size + TAG_BYTES]
        _recv_into(self._connection, record)
        self._counter += 1
        self.received_bytes += size
        try:
            if out is not None:
                self._key.decrypt_into(nonce(self._counter), record, None, out)
                return None
            return self._key.decrypt(nonce(self._counter), record, None)
        except Exception as e:  # cryptography's InvalidTag: not sealed with this connection's key and counter
            raise Refused(f"a record that does not open ({type(e).__name__})") from None


def _read_error(failure: BaseException | None, what: memoryview | int) -> BaseException:
    """What a read raises once the stream has ended: Refused for a record that did not open, else the end of
    the stream as asyncio's readers raise it."""
    if isinstance(failure, Refused):
        return Refused(str(failure))
    return asyncio.IncompleteReadError(b"", what if isinstance(what, int) else len(what))
