"""Transport throughput on loopback, side by side with a raw libp2p stream on the same machine.

``measure_throughput`` times float32 tensors sent between two transports (two libp2p daemons on 127.0.0.1)
until the receiver accepted them (a send returns once its message is in the receiver's mailbox; the
receiver's ``recv`` of it, a local hand-off, follows untimed), and the same number of bytes written to one
persistent bare hivemind binary stream between the same two daemons until the receiver answered (an 8-byte
length, the bytes, a 1-byte answer: the least a message with an acknowledgement can cost over libp2p),
written and read on the transports' own event loop threads, all in this one process. The ratio says what our
framing, validation, copies and the synchronous facade's thread hops cost over libp2p itself.

The machine is shared and its load swings within seconds, so the two are interleaved — one transport
message, then one raw message, repeated — and the median of each is reported. Two patterns:

- ``sequential``: one message at a time, each waited for (send, then recv) before the next;
- ``streamed``: ``window`` messages handed to ``send_async(copy=False)`` at once and waited for with one
  ``wait_all`` (the runtime's pattern: it hands over the tensors it sends and waits for a step's sends
  together), against the same number written back to back on the raw stream before reading their answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2ptrain.futures import wait_all
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import MessageKind, Tag

logger = logging.getLogger(__name__)

MIB = 1 << 20
RUN = "bench"
RAW_PROTOCOL = "p2ptrain.bench.raw"
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Throughput:
    size_mib: int
    pattern: str  # "sequential" or "streamed" (see the module docstring)
    transport_mb_per_s: float  # 1 MB = 10^6 bytes
    raw_stream_mb_per_s: float
    repeats: int

    @property
    def ratio(self) -> float:
        return self.transport_mb_per_s / self.raw_stream_mb_per_s


def measure_throughput(sizes_mib: Sequence[int] = (1, 4, 16, 64), repeats: int = 5, window: int = 8) -> list[Throughput]:
    """Median MB/s over ``repeats`` interleaved rounds per size and pattern, transport beside raw stream."""
    sizes_mib = sorted(set(sizes_mib))
    config = TransportConfig(max_message_bytes=max(sizes_mib) * MIB,
                             max_buffered_bytes=2 * window * max(sizes_mib) * MIB)
    results = []
    with Transport(RUN, config) as receiver, Transport(RUN, config, initial_peers=receiver.visible_maddrs) as sender, \
            RawPair(sender, receiver) as raw:
        parts = itertools.count()
        for size in sizes_mib:
            tensor = torch.randn(size * MIB // 4)
            for pattern, count in (("sequential", 1), ("streamed", window)):
                ours, theirs = [], []
                for _ in range(repeats + 1):  # the first round is a warm-up (stream setup, page faults)
                    tags = [Tag(RUN, 0, 0, MessageKind.BENCH, micro_batch=k, part=next(parts)) for k in range(count)]
                    ours.append(_transport_round(sender, receiver, tags, tensor))
                    theirs.append(raw.round(size * MIB, count))
                results.append(Throughput(size, pattern, _rate(size, count, ours[1:]), _rate(size, count, theirs[1:]),
                                          repeats))
                logger.info("%s %d MiB: transport %.0f MB/s, raw stream %.0f MB/s", pattern, size,
                            results[-1].transport_mb_per_s, results[-1].raw_stream_mb_per_s)
    return results


def throughput_table(results: Sequence[Throughput]) -> str:
    """The results as the table ``p2ptrain bench runtime`` prints."""
    lines = ["transport throughput on loopback beside one persistent raw libp2p stream, interleaved "
             "(median of rounds; 1 MB = 1e6 bytes)",
             f"{'size MiB':>8} {'pattern':>10} {'transport MB/s':>14} {'raw stream MB/s':>16} {'ratio':>6}"]
    for r in results:
        lines.append(f"{r.size_mib:>8} {r.pattern:>10} {r.transport_mb_per_s:>14.0f} {r.raw_stream_mb_per_s:>16.0f} "
                     f"{r.ratio:>6.2f}")
    return "\n".join(lines)


def _rate(size_mib: int, count: int, seconds: list[float]) -> float:
    return count * size_mib * MIB / statistics.median(seconds) / 1e6


def _transport_round(sender: Transport, receiver: Transport, tags: list[Tag], tensor: torch.Tensor) -> float:
    start_s = time.perf_counter()
    if len(tags) == 1:
        sender.send(receiver.peer_id, tags[0], tensor)
    else:
        wait_all([sender.send_async(receiver.peer_id, tag, tensor, TIMEOUT_S, copy=False) for tag in tags])
    seconds = time.perf_counter() - start_s  # every message is in the receiver's mailbox
    for tag in tags:
        assert receiver.recv(tag, sender.peer_id, tensor.shape, tensor.dtype).shape == tensor.shape
    return seconds


class RawPair:
    """One persistent bare stream between the two transports' own libp2p daemons, its ends on the transports'
    own event loop threads: the same processes, connection and threads carry both, so the comparison holds
    only what the transport adds, not which of four daemons the operating system happened to favour."""

    def __init__(self, sender: Transport, receiver: Transport):
        self._sender, self._receiver = sender, receiver

    def __enter__(self) -> RawPair:
        self._receiver.run_coroutine(self._receiver.p2p.add_binary_stream_handler(RAW_PROTOCOL, _sink), TIMEOUT_S)
        self._sender.run_coroutine(self._open(), TIMEOUT_S)
        return self

    def __exit__(self, *exc_info) -> None:
        self._sender.run_coroutine(self._close(), TIMEOUT_S)
        self._receiver.run_coroutine(self._receiver.p2p.remove_binary_stream_handler(RAW_PROTOCOL), TIMEOUT_S)

    def round(self, size_bytes: int, count: int) -> float:
        """Seconds to write ``count`` messages of ``size_bytes`` and read their answers (timed on the loop)."""
        return self._sender.run_coroutine(self._round(size_bytes, count), TIMEOUT_S)

    async def _open(self) -> None:
        _, self._reader, self._writer = await self._sender.p2p.call_binary_stream_handler(self._receiver.peer_id,
                                                                                          RAW_PROTOCOL)

    async def _round(self, size_bytes: int, count: int) -> float:
        payload = memoryview(bytes(size_bytes))
        start_s = time.perf_counter()
        for _ in range(count):
            self._writer.write(size_bytes.to_bytes(8, "big"))
            for offset in range(0, size_bytes, MIB):
                self._writer.write(payload[offset : offset + MIB])
                await self._writer.drain()
        await self._reader.readexactly(count)
        return time.perf_counter() - start_s

    async def _close(self) -> None:
        self._writer.close()


async def _sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read length-prefixed messages, answer each with one byte, until the stream ends."""
    try:
        while True:
            size = int.from_bytes(await reader.readexactly(8), "big")
            received = 0
            while received < size:
                chunk = await reader.read(min(MIB, size - received))
                if not chunk:
                    return
                received += len(chunk)
            writer.write(b"\x01")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        writer.close()
