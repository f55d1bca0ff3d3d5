"""A peer outside the run that attacks the agents' receive buffers (for the tests; not a test module).

    python rogue_sender.py RUN BOOTSTRAP_MADDR...
    python rogue_sender.py RUN @WORKDIR   # waits (120 s at most) for the swarm's WORKDIR/bootstrap.maddrs

It has a real identity and joins the run's DHT through the bootstrap (but publishes no peer record), reads
the agents' records, dials each and, while it runs:

* *trickles*: opens four tensor streams to each agent, each announcing the largest message the transport
  allows (256 MiB) in the run's first epoch, then sends a byte every two seconds;
* *floods*: every second sends each agent eight full 1 MiB messages of fresh tags inside its window.

Prints one line per agent attacked and, on SIGTERM, how many messages were refused and for what.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from pathlib import Path

from hivemind.proto import runtime_pb2

from p2ptrain.cli import configure_logging
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import Header, Tag
from p2ptrain.net.transport.replies import first_reply, parse_reply

TRICKLES_PER_AGENT = 4
FLOOD_PER_SECOND = 8
FLOOD_BYTES = 1 << 20
refused: collections.Counter = collections.Counter()


async def push(transport: Transport, peer: str, header: Header, pieces) -> None:
    stub = transport.stub(peer)
    try:
        responses = await asyncio.wait_for(transport.open_stream(peer, lambda: stub.rpc_push(pieces)), 30)
        reply = parse_reply(await first_reply(responses, peer))
        refused[str(reply.code) if reply.error else "taken"] += 1  # the code's word: the test reads it back
    except Exception as e:  # noqa: BLE001 - a broken stream is one more outcome to count
        refused[type(e).__name__] += 1


async def trickle(transport: Transport, peer: str, tag: Tag) -> None:
    header = Header(tag, "uint8", (TransportConfig().max_message_bytes,))

    async def pieces():
        yield runtime_pb2.ExpertRequest(uid=tag.key, metadata=header.encode(), tensors=[runtime_pb2.Tensor(buffer=b"x")])
        while True:
            await asyncio.sleep(2.0)
            yield runtime_pb2.ExpertRequest(uid=tag.key, tensors=[runtime_pb2.Tensor(buffer=b"x")])

    await push(transport, peer, header, pieces())


async def flood(transport: Transport, peer: str, run: str, round_: int) -> None:
    payload = b"\0" * FLOOD_BYTES
    for k in range(FLOOD_PER_SECOND):
        tag = Tag(run, 0, 0, "activation", micro_batch=1000 + round_ * FLOOD_PER_SECOND + k)
        header = Header(tag, "uint8", (FLOOD_BYTES,))

        async def pieces(header=header, tag=tag):
            yield runtime_pb2.ExpertRequest(uid=tag.key, metadata=header.encode(), tensors=[runtime_pb2.Tensor(buffer=payload)])

        await push(transport, peer, header, pieces())


def _bootstrap(args: tuple[str, ...]) -> tuple[str, ...]:
    """The bootstrap's addresses: given, or (``@WORKDIR``) read once the swarm has written them."""
    if len(args) != 1 or not args[0].startswith("@"):
        return args
    path, deadline = Path(args[0][1:]) / "bootstrap.maddrs", time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return tuple(path.read_text().split())
        time.sleep(0.2)
    raise SystemExit(f"no bootstrap address line at {path} within 120 s")


def main(run: str, *bootstrap: str) -> None:
    configure_logging(0)
    bootstrap = _bootstrap(bootstrap)  # (started beside the swarm: its imports are done by now)
    with StopSignal() as stop:
        dht = SwarmDHT(run, DHTConfig(initial_peers=bootstrap, host_maddrs=("/ip4/127.0.0.1/tcp/0",))).start()
        transport = Transport(run, TransportConfig(), dht=dht.hivemind_dht)
        attacked: set[str] = set()
        round_ = 0
        try:
            while not stop.wait(1.0):
                for peer, record in dht.read_peers().items():
                    if peer not in attacked:
                        try:
                            transport.connect(peer, record.maddrs, 10)
                        except Exception:  # noqa: BLE001 - try again next round
                            continue
                        attacked.add(peer)
                        print(f"attacking {peer}", flush=True)
                        for k in range(TRICKLES_PER_AGENT):
                            transport._submit(trickle(transport, peer, Tag(run, 0, 0, "activation", part=k)))
                for peer in attacked:
                    transport._submit(flood(transport, peer, run, round_))
                round_ += 1
        finally:
            print(f"refused: {dict(refused)}", flush=True)
            transport.shutdown()
            dht.shutdown()
            time.sleep(0.1)


if __name__ == "__main__":
    main(*sys.argv[1:])
