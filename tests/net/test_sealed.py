"""A direct connection's sealed bytes (``net/transport/sealed.py``) over a real loopback socket pair: exact both
ways, tampering refused, a cancelled read or a vanished peer ending the connection and its threads."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from p2ptrain.net.transport import sealed
from p2ptrain.net.transport.sealed import Refused, SealedConnection

pytestmark = pytest.mark.timeout(60)

KEYS = (AESGCM(b"a" * 32), AESGCM(b"b" * 32))


def _pair(loop) -> tuple[SealedConnection, SealedConnection]:
    a, b = socket.socketpair()
    return (SealedConnection(a, KEYS[0], KEYS[1], loop, "a"), SealedConnection(b, KEYS[1], KEYS[0], loop, "b"))


def _threads_of(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(f"-{name}") and t.name.startswith("p2ptrain-sealed")]


def test_bytes_arrive_exact_in_place_and_small_writes_travel_together():
    async def main():
        left, right = _pair(asyncio.get_running_loop())
        payload = os.urandom(3 * sealed.RECORD_BYTES + 12345)  # several records, the last one short
        heads = [os.urandom(n) for n in (1, 7, 300)]
        for head in heads:  # small writes: queued together, one record
            left.writer.write(head)
        left.writer.write(payload)
        left.writer.write(b"tail")
        await left.writer.drain()
        for head in heads:
            assert await right.reader.readexactly(len(head)) == head
        landing = bytearray(len(payload))
        await right.reader.readinto(memoryview(landing))
        assert landing == payload and await right.reader.readexactly(4) == b"tail"
        right.writer.write(b"ok")  # and back
        assert await left.reader.readexactly(2) == b"ok"
        left.close()
        with pytest.raises(asyncio.IncompleteReadError):  # our direction ended: the stream's end, as asyncio's
            await right.reader.readexactly(1)
        right.close()
        await asyncio.wait_for(right.writer.wait_closed(), 10)

    asyncio.run(main())


def test_a_tampered_record_is_refused_and_ends_the_connection():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        receiver = SealedConnection(b, KEYS[1], KEYS[0], loop, "tampered")
        record = bytearray(sealed.seal_record(KEYS[0], 2, b"x" * 100))
        record[20] ^= 1  # one bit of the ciphertext
        a.sendall(record)
        with pytest.raises(Refused):
            await receiver.reader.readexactly(100)
        assert receiver.aborted
        for _ in range(200):  # both threads end, the socket closes
            if not _threads_of("tampered"):
                break
            await asyncio.sleep(0.01)
        assert not _threads_of("tampered")
        a.close()

    asyncio.run(main())


def test_a_record_of_another_connection_does_not_open():
    """Replayed from another connection (other keys) or out of order (another counter): refused."""
    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        receiver = SealedConnection(b, KEYS[1], KEYS[0], loop, "replay")
        a.sendall(sealed.seal_record(KEYS[0], 7, b"hello"))  # the right key, a counter it is not at
        with pytest.raises(Refused):
            await receiver.reader.readexactly(5)
        a.close()

    asyncio.run(main())


def test_a_read_cancelled_midway_cuts_the_connection_and_its_threads_end():
    async def main():
        left, right = _pair(asyncio.get_running_loop())
        landing = bytearray(1 << 20)
        left.writer.write(b"x" * 1000)  # a part of what the reader waits for
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(right.reader.readinto(memoryview(landing)), 0.3)
        assert right.aborted
        with pytest.raises(asyncio.IncompleteReadError):
            await right.reader.readexactly(1)
        with pytest.raises(ConnectionError):  # the other end finds the connection gone
            for _ in range(100):
                left.writer.write(b"y" * 65536)
                await left.writer.drain()
                await asyncio.sleep(0.01)
        for _ in range(200):
            if not _threads_of("a") and not _threads_of("b"):
                break
            await asyncio.sleep(0.01)
        assert not _threads_of("a") and not _threads_of("b")

    asyncio.run(main())


def test_small_records_read_ahead_come_before_the_rest_of_a_read():
    """A read that the opened bytes answer in part: what the thread opened ahead meanwhile is not skipped."""
    async def main():
        left, right = _pair(asyncio.get_running_loop())
        for round_ in range(200):
            small = [os.urandom(5000) for _ in range(3)]
            for part in small:  # three small messages, each a record that may be read ahead
                left.writer.write(part)
                await left.writer.drain()
                await asyncio.sleep(0)
            big = os.urandom(sealed.SMALL_BYTES + 1)
            left.writer.write(big)
            landing = bytearray(sum(map(len, small)) + len(big))
            await right.reader.readinto(memoryview(landing))
            assert landing == b"".join(small) + big, round_
        left.close()
        right.close()

    asyncio.run(main())
