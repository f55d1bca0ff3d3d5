"""Tensor throughput to a peer behind NAT through the relay, beside the direct data plane and a bare TCP pair, on a
real network the kernel builds (namespaces, veths, a NAT router: ``tests/realnet/netns.py``). As root:

    python benchmarks/relay.py [--sizes 16,64] [--repeats 7] [--uplink-mbit 100] [--logs DIR]

Hosts on one bridged segment (198.18.0.0/24): ``relay`` runs ``p2ptrain bootstrap`` as an organiser does (public,
relay service and forwarding on); ``pub`` and ``pub2`` are public peers (a transport each, forwarding set up as an
agent's); ``home`` sits behind a router that masquerades it and drops every new inbound connection, and joins as a
volunteer does (a DHT peer with private reachability, a reservation on the relay, the transport on its daemon).
For each size, interleaved rounds, the median MB/s (10^6 bytes/s) of one float32 tensor sent and accepted
(``Transport.send``; the receiver's ``recv`` follows), after a warm-up round:

- ``tcp``: a plaintext TCP socket pair pub -> pub2 across the same veths and bridge: the wire's ceiling;
- ``direct``: pub -> pub2, the transport's direct data plane (sealed TCP): the baseline;
- ``relay``: pub -> home, what the transport uses for a peer behind NAT: the direct plane cannot reach the home, and
  pub's route (``forward.Routes``, learnt from the home's circuit address) sends through the relay's stream
  forwarding: ``p2ptrain/forward/1`` to the relay, ``p2ptrain/forward-in/1`` on to the home over the connection
  the home opened, spliced by the bootstrap's Python process (``net/nat/forward.py``);
- ``circuit``: pub2 -> home through a libp2p circuit relayed by the same bootstrap's p2pd (pub2 has no route to
  the home, so its daemon dials the home's ``/p2p-circuit`` address): what libp2p's own relay carries. p2pd resets
  some circuits after 131072 bytes, whatever its ``-relayDataLimit``; the peers then lose each other, and the
  column says "cut" (why the transport does not use circuits for tensors).

``pub`` runs no DHT, so the home never dials it (a public agent a home has dialled answers it on that connection,
without the relay): ``relay`` is the path two homes take to each other, or a public agent to a home it has no
connection with. Then it prints what shows each path was used: the direct plane's verdicts and channels, pub's
route to the home and its libp2p connections (none to the home; pub2's only a circuit), the bytes the relay host's
interface moved and the CPU its processes took in each mode's measured rounds, and the bootstrap's own forwarding
counter. No shaping unless ``--uplink-mbit`` (every host's uplink, the relay's too: ``tc tbf``). Each peer is a
process of ``relay_peer.py`` in its namespace; the namespaces and every process in them are removed on exit, also
on an error, SIGINT or SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().with_name("relay_peer.py")  # each peer's process
sys.path[:0] = [str(REPO / "tests" / "realnet"), str(REPO / "tests" / "agent")]

from netns import Host, Network, unavailable_reason  # noqa: E402
from swarm_helpers import start_bootstrap  # noqa: E402

MIB = 1 << 20
STARTUP_S = 120.0  # a peer's DHT and daemon up
ROUND_S = 300.0  # one tensor sent and received, at worst on a loaded machine (more on a shaped uplink: _round_s)
PLANE_S = 30.0  # the sender's direct plane settles on each peer (reached, or given up on)
CIRCUIT_S = 30.0  # a tensor's deadline over the circuit (more on a shaped uplink): p2pd may cut it
STATUS_PERIOD_S = 2.0  # the bootstrap logs its forwarding counter this often


# --- the benchmark, in the root namespace ----------------------------------------------------------------------


class _Worker:
    """A peer's process in its namespace, given orders as JSON lines; every answer awaited under a deadline."""

    def __init__(self, net: Network, host: Host, name: str, spec: dict, workdir: Path):
        self.name, self.log, self.round_s = name, workdir / f"{name}.log", spec["round_s"]
        with open(self.log, "wb") as log:
            self.proc = net.popen(host, [sys.executable, str(PEER), json.dumps(spec)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.peer, self.maddrs = "", []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def ready(self) -> _Worker:
        hello = self.answer(STARTUP_S)
        self.peer, self.maddrs = hello["peer"], hello["maddrs"]
        return self

    def post(self, name: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": "call", "name": name, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name} gave no answer within {timeout_s:.0f} s (its log: {self.log})") from None
        if line is None:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()}); its log: {self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']} (its log: {self.log})")
        return answer

    def ask(self, name: str, timeout_s: float | None = None, **args) -> dict:
        self.post(name, **args)
        return self.answer(timeout_s or self.round_s)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass  # Network.close kills what is left


def _round_s(max_bytes: int, uplink_mbit: float | None) -> float:
    """A round's deadline: ROUND_S, and four times the largest tensor's time on a shaped uplink."""
    return ROUND_S + (4 * max_bytes * 8 / (uplink_mbit * 1e6) if uplink_mbit else 0.0)


def _usage(host: Host) -> tuple[float, float, float, float]:
    """So far on ``host``: bytes its interface on the public segment received and sent, CPU seconds of its p2pd
    processes and of the others (the bootstrap's Python processes)."""
    out = subprocess.run(["ip", "-n", host.name, "-s", "-j", "link", "show", "wan0"], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    cpu = {"p2pd": 0.0, "other": 0.0}
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=10).stdout
    for pid in pids.split():
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        cpu["p2pd" if name == "p2pd" else "other"] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return stats["rx"]["bytes"], stats["tx"]["bytes"], cpu["p2pd"], cpu["other"]


class _Bench:
    """The rounds of each mode, interleaved; the relay host's use counted per mode (measured rounds only).

    A circuit that p2pd resets is not used again (``circuit_cut`` says why): its peers lose each other."""

    MODES = ("tcp", "direct", "relay", "circuit")

    def __init__(self, pub: _Worker, pub2: _Worker, home: _Worker, relay: Host, pub2_address: str,
                 uplink_mbit: float | None):
        self.pub, self.pub2, self.home, self.relay, self.pub2_address = pub, pub2, home, relay, pub2_address
        self.uplink_mbit = uplink_mbit
        self.index, self.counting, self.circuit_cut = 0, False, ""
        self.relay_use = {mode: [0.0] * 4 for mode in self.MODES}  # bytes in, out, CPU s of p2pd, of Python

    def _counted(self, mode: str, send) -> float | None:
        before = _usage(self.relay)
        elapsed = send()
        after = _usage(self.relay)
        for k in range(4):
            self.relay_use[mode][k] += (after[k] - before[k]) * self.counting
        return elapsed

    def _transport(self, sender: _Worker, receiver: _Worker, numel: int, deadline_s: float | None = None) -> float:
        self.index += 1
        receiver.post("recv", sender=sender.peer, index=self.index, numel=numel, deadline_s=deadline_s)
        try:
            elapsed = sender.ask("send", peer=receiver.peer, index=self.index, numel=numel,
                                 deadline_s=deadline_s)["elapsed_s"]
        except RuntimeError:
            with contextlib.suppress(RuntimeError):  # the receiver's wait ends too: the sender's error says why
                receiver.answer(receiver.round_s)
            raise
        receiver.answer(receiver.round_s)
        return elapsed

    def _circuit(self, numel: int) -> float | None:
        """pub2 -> home over the circuit, or None once p2pd has cut it."""
        if self.circuit_cut:
            return None
        deadline_s = CIRCUIT_S + (4 * numel * 32 / (self.uplink_mbit * 1e6) if self.uplink_mbit else 0.0)
        try:
            return self._transport(self.pub2, self.home, numel, deadline_s)
        except RuntimeError as e:
            self.circuit_cut = str(e).split(" (its log:")[0]  # the logs go once the run ends well
            return None

    def size(self, size_mib: int, repeats: int) -> dict[str, float]:
        """Median MB/s of each mode at ``size_mib``; the first round warms up (connections, buffers, the probe)."""
        nbytes = size_mib * MIB
        port = self.pub2.ask("tcp_listen", nbytes=nbytes, rounds=repeats + 1)["port"]
        rounds = {
            "tcp": lambda: self.pub.ask("tcp_send", host=self.pub2_address, port=port, nbytes=nbytes)["elapsed_s"],
            "direct": lambda: self._transport(self.pub, self.pub2, nbytes // 4),
            "relay": lambda: self._transport(self.pub, self.home, nbytes // 4),
            "circuit": lambda: self._circuit(nbytes // 4),
        }
        times: dict[str, list[float]] = {mode: [] for mode in self.MODES}
        for round_ in range(repeats + 1):
            self.counting = round_ > 0
            t = {mode: self._counted(mode, send) for mode, send in rounds.items()}
            if round_ == 0:
                self._settle()
            else:
                for mode, seconds in t.items():
                    if seconds is not None:
                        times[mode].append(seconds)
        return {mode: nbytes / statistics.median(ts) / 1e6 if len(ts) == repeats else None  # None: the circuit cut
                for mode, ts in times.items()}

    def _settle(self) -> None:
        """After the warm-up: pub's direct plane reaches pub2, pub's and pub2's have given up on the home."""
        states = {(w.name, peer.name): w.ask("plane", peer=peer.peer, wait_s=PLANE_S)
                  for w, peer in ((self.pub, self.pub2), (self.pub, self.home), (self.pub2, self.home))}
        if not states["pub", "pub2"]["reachable"] or any(
                s["reachable"] or not s["given_up"] for (_, to), s in states.items() if to == "home"):
            raise RuntimeError(f"the direct plane did not settle: {states}")


def _verify(bench: _Bench, relay_id: str, bytes_sent: int, workdir: Path) -> None:
    """Print what shows which path carried each mode's tensors."""
    to_pub2 = bench.pub.ask("inspect", peer=bench.pub2.peer)
    to_home = bench.pub.ask("inspect", peer=bench.home.peer)
    circuit = bench.pub2.ask("inspect", peer=bench.home.peer)
    home = bench.home.peer
    print(f"direct: pub's direct plane reached pub2 {to_pub2['reachable']}, "
          f"channels direct {to_pub2['channels_direct']}")
    print(f"relay: pub's direct plane reached home {to_home['reachable']} (gave up: {to_home['given_up']}), channels "
          f"direct {to_home['channels_direct']}; pub's route to home through {to_home['via']} (the relay: "
          f"{to_home['via'] == relay_id}); pub's libp2p connection to home: {to_home['connections'].get(home, 'none')}")
    print(f"circuit: pub2's direct plane reached home {circuit['reachable']} (gave up: {circuit['given_up']}); route "
          f"{circuit['via']}; pub2's libp2p connection to home: {circuit['connections'].get(home, 'none')}"
          + (f"; cut, not used again (p2pd resets some circuits after 131072 bytes): {bench.circuit_cut}"
             if bench.circuit_cut else ""))
    use = {mode: f"{rx / 1e6:.0f} MB in, {tx / 1e6:.0f} MB out, CPU {p2pd + py:.2f} s (p2pd {p2pd:.2f}, Python "
                 f"{py:.2f})" + (f" = {(p2pd + py) / (rx / 1e9):.1f} s per GB" if rx > bytes_sent / 2 else "")
           for mode, (rx, tx, p2pd, py) in bench.relay_use.items()}
    print(f"the relay host in the measured rounds ({bytes_sent / 1e6:.0f} MB of tensors per mode): "
          + "; ".join(f"{mode}: {use[mode]}" for mode in bench.MODES))
    time.sleep(STATUS_PERIOD_S + 1.0)
    log = (workdir / "bootstrap.log").read_text()
    counts = re.findall(r"forwarding \d+ streams now, \d+ so far, [\d.]+ MiB", log)
    print(f"the bootstrap's own counter: {counts[-1] if counts else 'not logged'} (warm-up rounds included)")


@click.command()
@click.option("--sizes", default="16,64", show_default=True, help="Tensor sizes in MiB, comma-separated.")
@click.option("--repeats", type=click.IntRange(1), default=7, show_default=True, help="Interleaved rounds (median).")
@click.option("--uplink-mbit", type=click.FloatRange(min=0.1), default=None, help="Shape every host's uplink (tc tbf).")
@click.option("--logs", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the peers' logs in this folder (else in a temporary one, kept only on failure).")
def main(sizes: str, repeats: int, uplink_mbit: float | None, logs: Path | None) -> None:
    try:
        sizes_mib = [int(s) for s in sizes.split(",")]
    except ValueError:
        sizes_mib = []
    if not sizes_mib or min(sizes_mib) < 1:
        raise click.BadParameter(f"{sizes!r} is not a comma-separated list of MiB", param_hint="--sizes")
    reason = unavailable_reason()
    if reason is not None:
        raise click.ClickException(reason)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # tear down on SIGTERM as on Ctrl-C
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-relay-", dir=logs))
    net, workers, failed = Network(), [], True
    try:
        _run(net, workers, workdir, sizes_mib, repeats, uplink_mbit)
        failed = False
    finally:
        for w in workers:
            w.close()
        net.close()
        signal.signal(signal.SIGTERM, previous)
        if failed or logs is not None:
            print(f"logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(net: Network, workers: list[_Worker], workdir: Path, sizes_mib: list[int], repeats: int,
         uplink_mbit: float | None) -> None:
    relay, pub, pub2 = (net.public(role, uplink_mbit) for role in ("relay", "pub", "pub2"))
    home = net.home("home", uplink_mbit=uplink_mbit)
    (workdir / "bootstrap.toml").write_text(f"status_period_s = {STATUS_PERIOD_S}\n")
    line = start_bootstrap(net, relay, workdir, "--config", str(workdir / "bootstrap.toml"))
    boot = [m for m in line.split() if "/ip4/127." not in m]
    relay_id = boot[0].rsplit("/p2p/", 1)[1]
    max_bytes = max(sizes_mib) * MIB
    spec = {"max_bytes": max_bytes, "initial_peers": boot, "round_s": _round_s(max_bytes, uplink_mbit)}
    for name, host, is_home in (("pub", pub, False), ("pub2", pub2, False), ("home", home, True)):
        workers.append(_Worker(net, host, name, {**spec, "home": is_home, "address": host.address}, workdir))
    pub_w, pub2_w, home_w = (w.ready() for w in workers)
    print(f"relay {relay.address} ({relay_id}); pub {pub.address}, pub2 {pub2.address}; home {home.address} behind "
          f"NAT {home.public_address}; uplinks {f'{uplink_mbit:g} Mbit/s' if uplink_mbit else 'unshaped'}", flush=True)
    print(f"home advertises {home_w.maddrs[0]}", flush=True)
    pub_w.ask("connect", peer=pub2_w.peer, maddrs=pub2_w.maddrs)
    pub_w.ask("route", peer=home_w.peer, maddrs=home_w.maddrs)  # as from the home's peer record
    pub2_w.ask("connect", peer=home_w.peer, maddrs=home_w.maddrs[:1])  # its circuit address; pub2 has no route
    bench = _Bench(pub_w, pub2_w, home_w, relay, pub2.address, uplink_mbit)
    print(f"{'MiB':>4} {'tcp MB/s':>9} {'direct':>7} {'relay':>7} {'circuit':>7} {'direct/tcp':>11} {'relay/tcp':>10} "
          f"{'relay/direct':>13} {'circuit/direct':>15}", flush=True)
    for size in sizes_mib:
        r = bench.size(size, repeats)
        circuit, vs_direct = ("cut", "-") if r["circuit"] is None else (f"{r['circuit']:.1f}",
                                                                        f"{r['circuit'] / r['direct']:.3f}x")
        print(f"{size:>4} {r['tcp']:>9.0f} {r['direct']:>7.0f} {r['relay']:>7.1f} {circuit:>7} "
              f"{r['direct'] / r['tcp']:>10.2f}x {r['relay'] / r['tcp']:>9.3f}x {r['relay'] / r['direct']:>12.3f}x "
              f"{vs_direct:>15}   through a relay: {r['direct'] / r['relay']:.1f}x slower than direct, "
              f"{r['tcp'] / r['relay']:.1f}x slower than tcp", flush=True)
    _verify(bench, relay_id, sum(sizes_mib) * MIB * repeats, workdir)


if __name__ == "__main__":
    main()
