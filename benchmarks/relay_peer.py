"""One peer of ``benchmarks/relay.py``, inside its network namespace: a transport set up as an agent's (a public
peer's own daemon, or a volunteer's DHT peer behind NAT), and the orders the benchmark writes on stdin, one JSON
object a line, each answered by one on stdout (the first answer: the peer's ID and addresses). Started by relay.py:

    ip netns exec <namespace> python benchmarks/relay_peer.py '<spec as JSON>'
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_plane import receive_rounds  # noqa: E402  (this script's folder)

from p2ptrain.net.dht.node import DHTConfig, SwarmDHT  # noqa: E402
from p2ptrain.net.nat.forward import setup_forwarding  # noqa: E402
from p2ptrain.net.nat.relay import RelayConfig  # noqa: E402
from p2ptrain.net.transport.endpoint import Transport, TransportConfig  # noqa: E402
from p2ptrain.net.transport.messages import MessageKind, Tag  # noqa: E402

RUN = "relaybench"
STARTUP_S = 120.0  # the DHT peer and forwarding set up


class Peer:
    """One transport as an agent sets it up (forwarding included), and the orders the benchmark gives it."""

    def __init__(self, spec: dict):
        torch.set_num_threads(1)
        self.spec, self.tensors, self.dht, self.tcp = spec, {}, None, None
        config = TransportConfig(max_message_bytes=spec["max_bytes"], max_buffered_bytes=4 * spec["max_bytes"],
                                 call_timeout_s=spec["round_s"])
        initial = tuple(spec["initial_peers"])
        relay = RelayConfig(reachability="private" if spec["home"] else "public")
        if spec["home"]:  # a volunteer: its DHT peer holds a reservation on the relay, the transport shares its daemon
            self.dht = SwarmDHT(RUN, DHTConfig(initial_peers=initial, relay=relay)).start()
            self.transport = Transport(RUN, config, dht=self.dht.hivemind_dht)
        else:
            self.transport = Transport(RUN, config, initial_peers=initial, host_maddrs=("/ip4/0.0.0.0/tcp/0",))
        self.routes = self.transport.run_coroutine(
            setup_forwarding(self.transport.p2p, relay, initial, config.call_timeout_s), STARTUP_S)
        maddrs = self.dht.get_visible_maddrs() if self.dht else self.transport.visible_maddrs
        self.hello = {"peer": str(self.transport.peer_id), "maddrs": [m for m in maddrs if "/ip4/127." not in m]}

    def _tensor(self, numel: int) -> torch.Tensor:
        if numel not in self.tensors:
            self.tensors[numel] = torch.randn(numel)
        return self.tensors[numel]

    @staticmethod
    def _tag(index: int) -> Tag:
        return Tag(RUN, 0, 0, MessageKind.BENCH, micro_batch=index)

    def op_connect(self, peer: str, maddrs: list[str]) -> dict:
        self.transport.connect(peer, maddrs)  # also starts the direct plane's probe of it
        return {}

    def op_route(self, peer: str, maddrs: list[str]) -> dict:
        """Learn ``peer``'s addresses as from its peer record (circuit ones: reach it through their relay)."""
        self.routes.update({peer: tuple(maddrs)})

        async def probe() -> None:
            self.transport.direct.probe(peer)

        self.transport.run_coroutine(probe(), 10.0)
        return {"via": self.routes.via(peer)}

    def op_plane(self, peer: str, wait_s: float) -> dict:
        """Wait until the direct plane has reached ``peer`` or given up on it (at most ``wait_s``)."""
        direct, deadline = self.transport.direct, time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if peer in direct.reachable or peer in direct._unreachable:  # noqa: SLF001
                break
            time.sleep(0.1)
        return {"reachable": peer in direct.reachable, "given_up": peer in direct._unreachable}  # noqa: SLF001

    def op_send(self, peer: str, index: int, numel: int, deadline_s: float | None) -> dict:
        tensor = self._tensor(numel)
        started = time.perf_counter()
        self.transport.send(peer, self._tag(index), tensor, timeout_s=deadline_s)
        return {"elapsed_s": time.perf_counter() - started}

    def op_recv(self, sender: str, index: int, numel: int, deadline_s: float | None) -> dict:
        self.transport.recv(self._tag(index), sender, shape=(numel,), dtype=torch.float32, timeout_s=deadline_s)
        return {}

    def op_tcp_listen(self, nbytes: int, rounds: int) -> dict:
        """A plaintext receiver: ``rounds`` times ``nbytes`` into one buffer, then b"k"."""
        listener = socket.create_server((self.spec["address"], 0))
        listener.settimeout(self.spec["round_s"])

        def serve() -> None:
            with listener, listener.accept()[0] as sock:
                sock.settimeout(self.spec["round_s"])
                receive_rounds(sock, nbytes, rounds)

        threading.Thread(target=serve, daemon=True).start()
        return {"port": listener.getsockname()[1]}

    def op_tcp_send(self, host: str, port: int, nbytes: int) -> dict:
        if self.tcp is None or self.tcp.getpeername() != (host, port):  # a new receiver for each size
            if self.tcp is not None:
                self.tcp.close()
            self.tcp = socket.create_connection((host, port), timeout=self.spec["round_s"])
        payload = memoryview(self._tensor(nbytes // 4).numpy()).cast("B")
        started = time.perf_counter()
        self.tcp.sendall(payload)
        if self.tcp.recv(1) != b"k":
            raise ConnectionError(f"the TCP receiver at {host}:{port} closed before its answer")
        return {"elapsed_s": time.perf_counter() - started}

    def op_inspect(self, peer: str) -> dict:
        """What carries our tensors to ``peer``: the direct plane's verdict, the route, libp2p's connections."""
        infos = self.transport.run_coroutine(self.transport.p2p.list_peers(), 10.0)
        channels = self.transport._channels._pools.get(peer, [])  # noqa: SLF001
        return {**self.op_plane(peer, 0.0), "via": self.routes.via(peer),
                "channels_direct": [c.is_direct for c in channels],
                "connections": {str(i.peer_id): [str(a) for a in i.addrs] for i in infos}}

    def close(self) -> None:
        self.transport.shutdown()
        if self.dht is not None:
            self.dht.shutdown()


def serve_orders(spec: dict) -> None:
    """A peer's process: one JSON answer on stdout per JSON order on stdin, the first its peer ID and addresses."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to the log, not among the answers
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # shut the transport down on the way out
    peer = Peer(spec)
    try:
        answers.write(json.dumps(peer.hello) + "\n")
        for line in sys.stdin:
            order = json.loads(line)
            if order.pop("op") == "quit":
                break
            try:
                answer = getattr(peer, "op_" + order.pop("name"))(**order)
            except Exception as e:  # noqa: BLE001 - the benchmark raises it with this peer's name
                answer = {"error": f"{type(e).__name__}: {e}"}
            answers.write(json.dumps(answer) + "\n")
    finally:
        peer.close()


if __name__ == "__main__":
    serve_orders(json.loads(sys.argv[1]))
