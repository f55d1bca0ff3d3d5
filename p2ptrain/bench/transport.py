"""Transport throughput on loopback, side by side with raw libp2p streams on the same machine.

``measure_throughput`` times ``send`` + ``recv`` of float32 tensors between two transports (two libp2p
daemons on 127.0.0.1), and the same number of bytes written to a bare hivemind binary stream between two
other daemons: the ratio says what our framing, validation and copies cost over libp2p itself. The machine
is shared, so both are measured in one run and the median of several repeats is reported.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from p2ptrain.net.messages import Tag
from p2ptrain.net.transport import Transport, TransportConfig

logger = logging.getLogger(__name__)

MIB = 1 << 20
RUN = "bench"
RAW_PROTOCOL = "p2ptrain.bench.raw"


@dataclass(frozen=True)
class Throughput:
    size_mib: int
    transport_mb_per_s: float  # 1 MB = 10^6 bytes
    raw_stream_mb_per_s: float
    repeats: int

    @property
    def ratio(self) -> float:
        return self.transport_mb_per_s / self.raw_stream_mb_per_s


def measure_throughput(sizes_mib: Sequence[int] = (1, 4, 16, 64), repeats: int = 5) -> list[Throughput]:
    """Median MB/s over ``repeats`` transfers per size, for the transport and for a raw libp2p stream."""
    sizes_mib = sorted(set(sizes_mib))
    transport = _transport_rates(sizes_mib, repeats)
    raw = asyncio.run(_raw_rates(sizes_mib, repeats))
    return [Throughput(size, transport[size], raw[size], repeats) for size in sizes_mib]


def _transport_rates(sizes_mib: Sequence[int], repeats: int) -> dict[int, float]:
    config = TransportConfig(max_message_bytes=max(sizes_mib) * MIB, max_buffered_bytes=2 * max(sizes_mib) * MIB)
    rates = {}
    with Transport(RUN, config) as receiver, Transport(RUN, config, initial_peers=receiver.visible_maddrs) as sender:
        for part, size in enumerate(sizes_mib):
            tensor = torch.randn(size * MIB // 4)
            seconds = []
            for i in range(repeats + 1):  # the first is a warm-up (stream setup, page faults)
                tag = Tag(RUN, 0, 0, "bench", micro_batch=i, part=part)
                start_s = time.perf_counter()
                sender.send(receiver.peer_id, tag, tensor)
                received = receiver.recv(tag, sender.peer_id, tensor.shape, tensor.dtype)
                seconds.append(time.perf_counter() - start_s)
                assert received.shape == tensor.shape
            rates[size] = size * MIB / statistics.median(seconds[1:]) / 1e6
            logger.info("transport: %d MiB at %.0f MB/s", size, rates[size])
    return rates


async def _raw_rates(sizes_mib: Sequence[int], repeats: int) -> dict[int, float]:
    async def sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        size = int.from_bytes(await reader.readexactly(8), "big")
        received = 0
        while received < size:
            received += len(await reader.read(MIB))
        writer.write(b"\x01")
        await writer.drain()
        writer.close()

    receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    sender = await P2P.create(initial_peers=await receiver.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    rates = {}
    try:
        await receiver.add_binary_stream_handler(RAW_PROTOCOL, sink)
        for size in sizes_mib:
            payload = memoryview(bytes(size * MIB))
            seconds = []
            for _ in range(repeats + 1):
                start_s = time.perf_counter()
                _, reader, writer = await sender.call_binary_stream_handler(receiver.peer_id, RAW_PROTOCOL)
                writer.write((size * MIB).to_bytes(8, "big"))
                for offset in range(0, len(payload), MIB):
                    writer.write(payload[offset : offset + MIB])
                    await writer.drain()
                await asyncio.wait_for(reader.readexactly(1), timeout=60)
                writer.close()
                seconds.append(time.perf_counter() - start_s)
            rates[size] = size * MIB / statistics.median(seconds[1:]) / 1e6
            logger.info("raw stream: %d MiB at %.0f MB/s", size, rates[size])
    finally:
        await sender.shutdown()
        await receiver.shutdown()
    return rates
