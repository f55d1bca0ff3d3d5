"""The direct data plane beside libp2p and a plain TCP socket pair, in one run on this machine (issue 46).

    python benchmarks/data_plane.py [--sizes 16,64] [--repeats 7]

For each size, interleaved rounds (the machine's load swings within seconds), the median MB/s (10^6 bytes/s)
of one float32 tensor moved and acknowledged, the sender in this process and the receiver in another, as two
agents are:

- ``tcp``: a plaintext TCP socket pair on loopback in Python (blocking sockets, the receiver reading into one
  preallocated buffer, a 1-byte answer): what the machine moves without any protocol;
- ``libp2p``: two transports (``transport.direct`` off), ``send`` until accepted (the receiver's ``recv`` follows);
- ``direct``: the same with ``transport.direct`` on (sealed with AES-GCM, ``net/transport/direct.py``);

and what the encryption costs on its own: AES-GCM sealing and opening a 4 MiB record (the direct plane's
pieces) on one core. Ratios are against ``tcp`` of the same round.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import click
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain.net.transport.endpoint import Transport, TransportConfig  # noqa: E402
from p2ptrain.net.transport.messages import MessageKind, Tag  # noqa: E402

MIB = 1 << 20
RUN = "dataplane"


def receive_rounds(sock: socket.socket, nbytes: int, rounds: int) -> None:
    """A plaintext pair's receiving end: ``rounds`` times, ``nbytes`` into one buffer, then b"k"."""
    buffer = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += sock.recv_into(buffer[got:], nbytes - got)
        sock.sendall(b"k")


def _tcp_receiver(port: int, nbytes: int, rounds: int) -> None:
    """The other process's end of the plaintext pair."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        receive_rounds(sock, nbytes, rounds)


class TcpPair:
    """A plaintext TCP socket pair on loopback, the receiver another process."""

    def __init__(self, nbytes: int, rounds: int):
        listener = socket.create_server(("127.0.0.1", 0))
        self.process = multiprocessing.get_context("spawn").Process(
            target=_tcp_receiver, args=(listener.getsockname()[1], nbytes, rounds), daemon=True)
        self.process.start()
        listener.settimeout(60)
        self.sender, _ = listener.accept()
        listener.close()

    def round(self, payload: memoryview) -> float:
        started = time.perf_counter()
        self.sender.sendall(payload)
        assert self.sender.recv(1) == b"k"
        return time.perf_counter() - started

    def close(self) -> None:
        self.sender.close()
        self.process.join(30)


def _transport_receiver(direct: bool, config: dict, orders, answers) -> None:
    """The other process's transport: it says where it listens, then receives what ``orders`` announce."""
    receiver = Transport(RUN, TransportConfig(direct=direct, **config))
    answers.put((str(receiver.peer_id), receiver.visible_maddrs))
    try:
        while (order := orders.get()) is not None:
            sender, index, numel = order
            tag = Tag(RUN, 0, 0, MessageKind.BENCH, micro_batch=index)
            receiver.recv(tag, sender, shape=(numel,), dtype=torch.float32)
            answers.put(index)
    finally:
        receiver.shutdown()


class TransportPair:
    """Our transport in this process sending to one in another process (``direct`` on or off)."""

    def __init__(self, direct: bool, config: dict):
        context = multiprocessing.get_context("spawn")
        self.orders, self.answers = context.Queue(), context.Queue()
        self.process = context.Process(target=_transport_receiver, args=(direct, config, self.orders, self.answers),
                                       daemon=True)
        self.process.start()
        self.peer, maddrs = self.answers.get(timeout=120)
        self.sender = Transport(RUN, TransportConfig(direct=direct, **config), initial_peers=maddrs)
        self.sender.connect(self.peer, maddrs)

    def round(self, tensor: torch.Tensor, index: int) -> float:
        self.orders.put((str(self.sender.peer_id), index, tensor.numel()))
        tag = Tag(RUN, 0, 0, MessageKind.BENCH, micro_batch=index)
        started = time.perf_counter()
        self.sender.send(self.peer, tag, tensor)
        elapsed = time.perf_counter() - started
        assert self.answers.get(timeout=120) == index
        return elapsed

    def close(self) -> None:
        self.orders.put(None)
        self.sender.shutdown()
        self.process.join(60)


def _aead_rate() -> tuple[float, float]:
    key, data, nonce = AESGCM(AESGCM.generate_key(128)), os.urandom(4 * MIB), bytes(12)
    out = bytearray(4 * MIB)
    sealed = key.encrypt(nonce, data, None)
    seal, open_ = [], []
    for _ in range(8):
        t = time.perf_counter()
        sealed = key.encrypt(nonce, data, None)
        seal.append(time.perf_counter() - t)
        t = time.perf_counter()
        key.decrypt_into(nonce, sealed, None, out)
        open_.append(time.perf_counter() - t)
    return 4 * MIB / statistics.median(seal) / 1e6, 4 * MIB / statistics.median(open_) / 1e6


@click.command()
@click.option("--sizes", default="16,64", show_default=True, help="Tensor sizes in MiB, comma-separated.")
@click.option("--repeats", type=click.IntRange(1), default=7, show_default=True, help="Interleaved rounds (median).")
def main(sizes: str, repeats: int) -> None:
    sizes_mib = [int(s) for s in sizes.split(",")]
    seal, open_ = _aead_rate()
    print(f"AES-GCM on one core, 4 MiB records: seal {seal:.0f} MB/s, open {open_:.0f} MB/s", flush=True)
    config = {"max_message_bytes": max(sizes_mib) * MIB, "max_buffered_bytes": 4 * max(sizes_mib) * MIB,
              "call_timeout_s": 60.0}
    pairs = {name: TransportPair(direct, config) for name, direct in (("libp2p", False), ("direct", True))}
    index = 0
    print(f"{'MiB':>4} {'tcp MB/s':>9} {'libp2p':>8} {'direct':>8} {'libp2p/tcp':>11} {'direct/tcp':>11} "
          f"{'direct/libp2p':>14}")
    try:
        for size in sizes_mib:
            tensor = torch.randn(size * MIB // 4)
            payload = memoryview(tensor.numpy()).cast("B")
            tcp = TcpPair(size * MIB, repeats + 1)
            times: dict[str, list[float]] = {"tcp": [], "libp2p": [], "direct": []}
            for round_ in range(repeats + 1):  # the first round warms up (connections, page faults)
                t = {"tcp": tcp.round(payload)}
                for name, pair in pairs.items():
                    index += 1
                    t[name] = pair.round(tensor, index)
                if round_:
                    for name, seconds in t.items():
                        times[name].append(seconds)
            tcp.close()
            rate = {name: size * MIB / statistics.median(ts) / 1e6 for name, ts in times.items()}
            print(f"{size:>4} {rate['tcp']:>9.0f} {rate['libp2p']:>8.0f} {rate['direct']:>8.0f} "
                  f"{rate['libp2p'] / rate['tcp']:>10.2f}x {rate['direct'] / rate['tcp']:>10.2f}x "
                  f"{rate['direct'] / rate['libp2p']:>13.2f}x", flush=True)
        direct = pairs["direct"].sender
        print(f"direct channels used: {[c.is_direct for c in direct._channels._pools.get(pairs['direct'].peer, [])]}")
    finally:
        for pair in pairs.values():
            pair.close()


if __name__ == "__main__":
    main()
