"""A small real network built from Linux network namespaces, for tests: an "internet" segment, public hosts
on it, and homes behind NAT routers, with uplinks the kernel shapes.

    with Network() as net:
        boot = net.public("boot")                        # 198.18.0.2 on the public segment
        home = net.home("home1", uplink_mbit=24)         # 10.201.1.2 behind router 198.18.0.101 (NAT)
        proc = net.popen(home, ["python", "-m", "p2ptrain", ...])

Layout (every namespace is created here and named ``p2pt<tag>-<role>``; nothing is added to the root
namespace, so nothing here can route to the machine's real network):

* ``wan``: a bridge, the "internet", 198.18.0.0/24 (RFC 2544's benchmarking range, never routed).
* a public host: one veth into the bridge, a WAN address, reachable by anyone on the segment.
* a home: a router namespace (WAN side on the bridge, LAN side 10.201.k.1/24) and a host namespace
  (10.201.k.2, default route through the router). The router masquerades the LAN behind its WAN address
  and drops every new inbound connection (conntrack: only replies come in), like a home router with no
  port forwarded. ``uplink_mbit`` shapes the router's WAN egress with a token bucket (``tc tbf``; this
  kernel has no netem, so latency is not added here); ``downlink_mbit`` its LAN egress alike, the traffic
  toward the home host.

Teardown (``close``, also on failure): every process still running inside the namespaces is killed, then
each namespace is deleted, which removes its veths, its qdiscs and its iptables rules with it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

WAN_PREFIX = "198.18.0"
LAN_PREFIX = "10.201"
COMMAND_TIMEOUT_S = 20.0


class Unavailable(RuntimeError):
    """Namespaces, veths, iptables or tc cannot be used here (the message says which)."""


@dataclass
class Host:
    name: str  # the namespace
    address: str  # the address others reach it at (a home host's is private: only its router's is public)
    router: str | None = None  # the home router's namespace
    public_address: str | None = None  # what the internet sees (the router's WAN address for a home)
    processes: list[subprocess.Popen] = field(default_factory=list)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why this machine cannot build the network (None when it can): root, ip, tc, iptables, a test netns."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y iproute2 iptables)"
    probe = f"p2pt{secrets.token_hex(3)}-probe"
    try:
        _run("ip", "netns", "add", probe)
        try:
            _run("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
            _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n")
            _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "8mbit",
                 "burst", "16kb", "latency", "50ms")
        finally:
            _run("ip", "netns", "del", probe, check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot build a test network here: {e}"
    return None


class Network:
    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._next_public = 2
        self._next_home = 1
        try:
            self.wan = self._namespace("wan")
            self._ns_run(self.wan, "ip", "link", "add", "br0", "type", "bridge")
            self._ns_run(self.wan, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # ---- building ---------------------------------------------------------------------------------------

    def _namespace(self, role: str) -> str:
        name = f"p2pt{self.tag}-{role}"
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        self._ns_run(name, "ip", "link", "set", "lo", "up")
        return name

    def _ns_run(self, ns: str, *argv: str) -> None:
        _run("ip", "netns", "exec", ns, *argv)

    def _plug_into_wan(self, ns: str, port: str, address: str) -> None:
        """A veth from ``ns`` (its end named wan0) into the bridge, with ``address`` on the ``ns`` side."""
        _run("ip", "-n", ns, "link", "add", "wan0", "type", "veth", "peer", "name", port, "netns", self.wan)
        self._ns_run(self.wan, "ip", "link", "set", port, "master", "br0")
        self._ns_run(self.wan, "ip", "link", "set", port, "up")
        self._ns_run(ns, "ip", "addr", "add", f"{address}/24", "dev", "wan0")
        self._ns_run(ns, "ip", "link", "set", "wan0", "up")

    def public(self, role: str, uplink_mbit: float | None = None) -> Host:
        """A host with a public address on the WAN segment."""
        ns = self._namespace(role)
        address = f"{WAN_PREFIX}.{self._next_public}"
        self._next_public += 1
        self._plug_into_wan(ns, f"p{self._next_public}", address)
        if uplink_mbit is not None:
            shape(ns, "wan0", uplink_mbit)
        host = Host(ns, address, public_address=address)
        self.hosts.append(host)
        return host

    def home(self, role: str, uplink_mbit: float | None = None, downlink_mbit: float | None = None) -> Host:
        """A host behind its own NAT router: it can dial out, nobody can dial in."""
        k = self._next_home
        self._next_home += 1
        router = self._namespace(f"{role}-gw")
        wan_address = f"{WAN_PREFIX}.{100 + k}"
        self._plug_into_wan(router, f"r{k}", wan_address)
        ns = self._namespace(role)
        lan = f"{LAN_PREFIX}.{k}"
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._ns_run(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan0")
        self._ns_run(router, "ip", "link", "set", "lan0", "up")
        self._ns_run(ns, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
        self._ns_run(ns, "ip", "link", "set", "eth0", "up")
        self._ns_run(ns, "ip", "route", "add", "default", "via", f"{lan}.1")
        self._ns_run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        ipt = ("iptables", "-w", "5")
        self._ns_run(router, *ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        self._ns_run(router, *ipt, "-A", "FORWARD", "-i", "wan0", "-m", "conntrack", "--ctstate",
                     "ESTABLISHED,RELATED", "-j", "ACCEPT")
        self._ns_run(router, *ipt, "-A", "FORWARD", "-i", "wan0", "-j", "DROP")
        self._ns_run(router, *ipt, "-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate",
                     "ESTABLISHED,RELATED", "-j", "ACCEPT")
        self._ns_run(router, *ipt, "-A", "INPUT", "-i", "wan0", "-j", "DROP")
        if uplink_mbit is not None:
            shape(router, "wan0", uplink_mbit)
        if downlink_mbit is not None:
            shape(router, "lan0", downlink_mbit)
        host = Host(ns, f"{lan}.2", router=router, public_address=wan_address)
        self.hosts.append(host)
        return host

    # ---- running ----------------------------------------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace (``ip netns exec`` execs it: the pid is the command's)."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.name, *argv], start_new_session=True, **kwargs)
        host.processes.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.name, *argv], capture_output=True, text=True,
                              timeout=timeout_s)

    # ---- teardown ---------------------------------------------------------------------------------------

    def close(self, grace_s: float = 20.0) -> None:
        """Stop what runs in the namespaces (SIGTERM, then SIGKILL after ``grace_s``), then delete them."""
        procs = [p for host in self.hosts for p in host.processes]
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(10)
        for ns in reversed(self._namespaces):
            for pid in _netns_pids(ns):  # anything our processes left behind in our namespaces
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shape(ns: str, device: str, rate_mbit: float) -> None:
    """A token bucket on ``device``'s egress: ``rate_mbit`` Mbit/s, a small burst, a bounded queue."""
    rate_kbit = int(rate_mbit * 1000)
    burst_bytes = max(4096, int(rate_mbit * 1e6 / 8 / 250))  # 4 ms at line rate: small against a transfer
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate",
         f"{rate_kbit}kbit", "burst", str(burst_bytes), "latency", "100ms")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _netns_pids(ns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]
