"""The access-link emulation against the kernel: a home whose uplink (or downlink) ``tc`` shapes at R, and the
same transfers through our transport on loopback with the emulator's uplink (or downlink) at R.

Two flows of n bytes each, at once: the home sends n to each of two public hosts over TCP (plain sockets, its
router's WAN egress a token bucket at R), or two public hosts each send n to the home (the router's LAN
egress at R); then a transport with ``set_access(uplink=R)`` sends n to each of two transports, or two
unshaped transports send n each to one with ``set_access(downlink=R)``. Latency stays out of both (this kernel
has no netem; the emulated links have none).

What each predicts: ``tc`` keeps one queue and interleaves the two TCP flows, about a fair share each, so both
finish near 2n/R; the emulator's FIFO passes the first message whole, then the second: the first is in at
n/R, the second at 2n/R. The makespan, 2n/R, is the same: it is what the test compares, within
``MAKESPAN_TOLERANCE`` of 2n/R, with both at or above the model's lower bound. Per flow they differ by
design: the planner's simulated objective uses the same FIFO. Run as root, ``-s`` prints what was measured::

    pytest -q -n 0 -s tests/realnet/test_access_link.py

Measured on the shared 2-core machine (load 8-10), 16 Mbit/s, 2 MB a flow, model 2.00 s, five runs: uplink,
tc 2.09-2.10 s (the first flow done at 1.54-1.90 s), emulated 2.01-2.11 s (first 1.02-1.11 s); downlink, tc
2.09-2.11 s (first 1.30-1.79 s), emulated 2.03-2.16 s (first 1.03-1.15 s).
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import pytest
import torch

from p2ptrain.net.transport.emulation import LinkEmulator
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import MessageKind, Tag

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RUN = "access"
RATE_MBIT = 16.0  # R: 2 MB/s
RATE_BYTES_PER_S = RATE_MBIT * 1e6 / 8
FLOW_BYTES = 2_000_000  # n: a flow alone takes 1 s at R, both 2 s
MODEL_S = 2 * FLOW_BYTES / RATE_BYTES_PER_S  # the makespan both should show
# tc counts every frame's 66 bytes of Ethernet, IP and TCP headers against R (4.6% of a 1448-byte segment);
# TCP's start and the go signal add a few tens of ms; the rest is room for a busy machine's scheduling.
MAKESPAN_TOLERANCE = 0.15
# The token bucket starts full: its burst (netns.shape: 4 ms at R) goes at line rate.
TC_BURST_S = 0.004
# Small pieces: a receiver books its downlink when a message's first piece is in, the sooner for them.
CONFIG = TransportConfig(call_timeout_s=30.0, chunk_bytes=64 << 10)

# Run in the namespaces as ``python -c FLOWS <role> <mode> <bytes> [host:port ...]``. A peer listens on port
# 0, prints its port, takes one connection; "recv": reads the bytes and prints when they were all in;
# "send": waits for a go byte, then sends them. The home dials every peer, then (its clock's start) "send":
# sends the bytes to all at once; "recv": sends each a go byte and reads all at once, printing when each was
# in.
FLOWS = r"""
import json, socket, sys, threading, time

def read_all(conn, size):
    view, left = memoryview(bytearray(1 << 16)), size
    while left:
        got = conn.recv_into(view, min(left, len(view)))
        if not got:
            sys.exit(f"the connection closed with {left} of {size} bytes to go")
        left -= got
    return time.monotonic()

role, mode, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "peer":
    server = socket.create_server(("0.0.0.0", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    if mode == "recv":
        print(json.dumps({"done_s": [read_all(conn, size)]}), flush=True)
    else:
        read_all(conn, 1)
        conn.sendall(bytes(size))
        conn.recv(1)  # the home closes once it has read everything
else:
    addresses = [a.rsplit(":", 1) for a in sys.argv[4:]]
    conns = [socket.create_connection((host, int(port)), timeout=60) for host, port in addresses]
    done = [None] * len(conns)

    def flow(i):
        if mode == "send":
            conns[i].sendall(bytes(size))
            conns[i].shutdown(socket.SHUT_WR)
            conns[i].recv(1)  # the peer closes once it has read everything
        else:
            conns[i].sendall(b"g")
            done[i] = read_all(conns[i], size)

    threads = [threading.Thread(target=flow, args=(i,)) for i in range(len(conns))]
    start_s = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"start_s": start_s, "done_s": done}), flush=True)
"""


def tc_flows(network, home, peers, home_mode: str) -> list[float]:
    """Two flows between ``home`` and ``peers`` over the kernel's shaped links: each one's completion, in
    seconds after the home started them (monotonic clocks agree across network namespaces)."""
    peer_mode = "recv" if home_mode == "send" else "send"
    procs = [network.popen(peer, [sys.executable, "-c", FLOWS, "peer", peer_mode, str(FLOW_BYTES)],
                           stdout=subprocess.PIPE, text=True) for peer in peers]
    ports = [int(proc.stdout.readline()) for proc in procs]
    addresses = [f"{peer.address}:{port}" for peer, port in zip(peers, ports, strict=True)]
    home_argv = [sys.executable, "-c", FLOWS, "home", home_mode, str(FLOW_BYTES), *addresses]
    home_proc = network.popen(home, home_argv, stdout=subprocess.PIPE, text=True)
    home_out, _ = home_proc.communicate(timeout=60)
    assert home_proc.returncode == 0, home_out
    started = json.loads(home_out)
    if home_mode == "recv":
        done_s = started["done_s"]
    else:
        done_s = [json.loads(proc.communicate(timeout=60)[0])["done_s"][0] for proc in procs]
    for proc in procs:
        proc.wait(timeout=60)
    return sorted(t - started["start_s"] for t in done_s)


def emulated_flows(senders: list[Transport], receivers: list[Transport]) -> list[float]:
    """Two messages of n bytes, ``senders[i]`` to ``receivers[i]``, sent at once through the transport (after
    a small one each, which sets up connections and streams): each one's delivery, in seconds after the
    sends."""
    warmup, tag = Tag(RUN, 0, 0, "warmup"), Tag(RUN, 0, 0, MessageKind.ACTIVATION)
    for sender, receiver in zip(senders, receivers, strict=True):
        sender.send(receiver.peer_id, warmup, torch.zeros(1))
        receiver.recv(warmup, sender.peer_id, (1,), torch.float32)
    times: list[concurrent.futures.Future[float]] = []
    for sender, receiver in zip(senders, receivers, strict=True):
        done: concurrent.futures.Future[float] = concurrent.futures.Future()

        def noted(receiving: concurrent.futures.Future, done=done) -> None:
            if receiving.exception() is None:
                done.set_result(time.monotonic())
            else:
                done.set_exception(receiving.exception())

        receiver.recv_async(tag, sender.peer_id, (FLOW_BYTES // 4,), torch.float32).add_done_callback(noted)
        times.append(done)
    message = torch.zeros(FLOW_BYTES // 4)
    sent_s = time.monotonic()
    sendings = [sender.send_async(receiver.peer_id, tag, message)
                for sender, receiver in zip(senders, receivers, strict=True)]
    for sending in sendings:
        sending.result(timeout=60)
    return sorted(done.result(timeout=60) - sent_s for done in times)


def check(direction: str, real: list[float], emulated: list[float]) -> None:
    print(f"{direction} of {RATE_MBIT:g} Mbit/s, 2 × {FLOW_BYTES} bytes (model {MODEL_S:.2f} s): "
          f"tc flows {real[0]:.2f} and {real[1]:.2f} s, emulated {emulated[0]:.2f} and {emulated[1]:.2f} s")
    # the emulator's FIFO cannot be faster than it books: the first whole message n/R, both 2n/R
    assert emulated[0] >= MODEL_S / 2 and emulated[1] >= MODEL_S, (real, emulated)
    assert real[1] >= MODEL_S - TC_BURST_S, (real, emulated)  # nor can tc pass more than R, its burst aside
    assert abs(real[1] - emulated[1]) <= MAKESPAN_TOLERANCE * MODEL_S, (real, emulated)


def test_an_uplink_shared_by_two_flows_takes_as_long_as_tc_makes_it(network):
    home = network.home("home", uplink_mbit=RATE_MBIT)
    peers = [network.public(f"pub{k}") for k in (1, 2)]
    real = tc_flows(network, home, peers, "send")

    with Transport(RUN, CONFIG) as first, Transport(RUN, CONFIG) as second:
        emulator = LinkEmulator()
        emulator.set_access(uplink_bytes_per_s=RATE_BYTES_PER_S)
        with Transport(RUN, CONFIG, initial_peers=first.visible_maddrs, emulator=emulator) as sender:
            sender.connect(second.peer_id, second.visible_maddrs)
            emulated = emulated_flows([sender, sender], [first, second])
    check("uplink", real, emulated)


def test_a_downlink_shared_by_two_flows_takes_as_long_as_tc_makes_it(network):
    home = network.home("home", downlink_mbit=RATE_MBIT)
    peers = [network.public(f"pub{k}") for k in (1, 2)]
    real = tc_flows(network, home, peers, "recv")

    emulator = LinkEmulator()
    emulator.set_access(downlink_bytes_per_s=RATE_BYTES_PER_S)
    with Transport(RUN, CONFIG, emulator=emulator) as receiver:
        with Transport(RUN, CONFIG, initial_peers=receiver.visible_maddrs) as first:
            with Transport(RUN, CONFIG, initial_peers=receiver.visible_maddrs) as second:
                emulated = emulated_flows([first, second], [receiver, receiver])
    check("downlink", real, emulated)
