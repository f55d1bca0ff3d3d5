"""What a run's reads cost the DHT: N real DHT peers on this machine, each storing its peer and links record,
then all reading the run's keys at once, as a swarm's agents poll; hivemind's defaults side by side with ours.

    python benchmarks/dht_load.py [--peers 16] [--rounds 10] [--variants hivemind,ours]
    python benchmarks/dht_load.py --stores --peers 48 --rounds 3 --hogs 24 --variants ours@all,ours

Per variant: the reads' seconds (median, 90th percentile, slowest), failed reads, and the CPU seconds all the
peers' DHT processes and p2pd daemons spent on the rounds, a round being every peer reading ``peers`` and
``links`` once. The variants differ only in hivemind's node options and beam (``net.dht.node.NODE_OPTIONS``,
``dht.beam_size``) and in whether a node remembers its signature checks (``validators.SignatureValidator``), run
one after the other on fresh peers: ``hivemind`` (its defaults), ``nocache`` (our options, its beam), ``narrow``
(its options, our beam), ``unremembered`` (ours, every signature checked afresh), ``ours``; ``ours@6``: ours with
a beam of 6.

``--stores``: each round is every peer storing a new links row at once instead (a swarm's link phase), beside
``--hogs`` busy processes (a loaded machine); ``@all``: the store waits for all five replicas (hivemind's
``await_all_replicas``, its default) instead of the first (``net.dht.node.STORE_OPTIONS``, ours).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import time

import psutil

from p2ptrain.net.dht import validators
from p2ptrain.net.dht.node import NODE_OPTIONS, STORE_OPTIONS, DHTConfig, SwarmDHT
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord

RUN = "dhtload"
HIVEMIND = {"num_replicas": 5, "cache_nearest": 1, "cache_refresh_before_expiry": 5}
# name: (node options, beam, signature verdicts remembered)
VARIANTS = {"hivemind": (HIVEMIND, 20, False), "nocache": (NODE_OPTIONS, 20, False),
            "narrow": (HIVEMIND, DHTConfig().beam_size, False), "unremembered": (NODE_OPTIONS, DHTConfig().beam_size, False),
            "ours": (NODE_OPTIONS, DHTConfig().beam_size, True)}


def _start(n: int, options: dict, beam: int) -> list[SwarmDHT]:
    base = dict(host_maddrs=("/ip4/127.0.0.1/tcp/0",), request_timeout_s=30.0, startup_timeout_s=60.0,
                shutdown_timeout_s=5.0, beam_size=beam)
    first = SwarmDHT(RUN, DHTConfig(**base))
    first.node_options = dict(options)
    first.start()
    peers = [first]
    initial = tuple(first.get_visible_maddrs())[:1]
    for i in range(1, n):
        dht = SwarmDHT(RUN, DHTConfig(initial_peers=initial, **base))
        dht.node_options = dict(options)
        peers.append(dht.start())
        print(f"\r  {i + 1}/{n} peers up", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return peers


def _processes(peers: list[SwarmDHT]) -> list[psutil.Process]:
    found = []
    for dht in peers:
        proc = psutil.Process(dht.hivemind_dht.pid)
        found += [proc, *proc.children(recursive=True)]
    return found


def _cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _publish(peers: list[SwarmDHT]) -> None:
    ids = [dht.peer_id for dht in peers]
    for i, dht in enumerate(peers):
        dht.publish_peer(PeerRecord("cpu", 8.0, 0.25, maddrs=tuple(dht.get_visible_maddrs())[:2]))
        row = {other: LinkMeasurement(0.01 + 0.001 * j, 100.0 + j) for j, other in enumerate(ids) if j != i}
        dht.publish_links(LinksRecord.from_peers(row))


def _read(dht: SwarmDHT) -> tuple[float, bool, int]:
    started = time.monotonic()
    try:
        peers, links = dht.read_peers(), dht.read_links()
        return time.monotonic() - started, True, min(len(peers), len(links))
    except Exception:  # a timeout counts as a failed read
        return time.monotonic() - started, False, 0


def _store(dht: SwarmDHT, ids: list[str], version: int) -> tuple[float, bool, int]:
    """A new links row of ``dht`` (to its next 12 peers), stored; its seconds and whether it was."""
    me = ids.index(dht.peer_id)
    row = {p: LinkMeasurement(0.01 + 0.001 * j + version * 1e-4, 100.0 + j) for j, p in enumerate(ids)
           if 0 < (j - me) % len(ids) <= 12}
    started = time.monotonic()
    try:
        stored = dht.publish_links(LinksRecord.from_peers(row, version, dict.fromkeys(row, 1)))
    except Exception:  # a timeout counts as a failed store
        stored = False
    return time.monotonic() - started, stored, len(ids) if stored else 0


def run_variant(name: str, n: int, rounds: int, stores: bool = False, hogs: int = 0) -> dict:
    base, _, tail = name.partition("@")
    options, beam, remembered = VARIANTS[base]
    beam = int(tail) if tail.isdigit() else beam
    validators.VERDICTS_KEPT = 4096 if remembered else 0  # read by the DHT processes forked from here
    peers = _start(n, options, beam)
    busy: list[subprocess.Popen] = []
    try:
        for dht in peers:
            dht.store_options = {**STORE_OPTIONS, "await_all_replicas": tail == "all"}
        _publish(peers)
        time.sleep(2.0)
        ids = [dht.peer_id for dht in peers]
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        processes = _processes(peers)
        cpu0, seconds, failed, short = _cpu_s(processes), [], 0, 0
        wall0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for r in range(rounds):
                calls = pool.map(lambda d, v=r + 2: _store(d, ids, v), peers) if stores else pool.map(_read, peers)
                for took, ok, seen in calls:
                    seconds.append(took)
                    failed += not ok
                    short += ok and seen < n
                print(f"\r  {name}: round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        wall, cpu = time.monotonic() - wall0, _cpu_s(processes) - cpu0
    finally:
        for proc in busy:
            proc.kill()
        for dht in peers:
            dht.shutdown()
    seconds.sort()
    return {"variant": name, "beam": beam, "median_s": statistics.median(seconds),
            "p90_s": seconds[int(0.9 * (len(seconds) - 1))], "max_s": seconds[-1], "failed": failed,
            "incomplete": short, "cpu_s": cpu, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--variants", default="hivemind,ours")
    parser.add_argument("--stores", action="store_true", help="every peer stores a new links row each round")
    parser.add_argument("--hogs", type=int, default=0, help="busy processes beside the rounds (a loaded machine)")
    args = parser.parse_args()
    rows = [run_variant(name, args.peers, args.rounds, args.stores, args.hogs) for name in args.variants.split(",")]
    what = "storing a new links row" if args.stores else "reading `peers` and `links`"
    print(f"{args.peers} peers, {args.rounds} rounds of every peer {what}, {args.hogs} busy processes beside")
    print(f"{'variant':>9} {'beam':>5} {'median s':>9} {'p90 s':>7} {'max s':>7} {'failed':>7} {'short':>6} "
          f"{'DHT CPU s':>10} {'wall s':>7}")
    for r in rows:
        print(f"{r['variant']:>9} {r['beam']:>5} {r['median_s']:>9.3f} {r['p90_s']:>7.3f} {r['max_s']:>7.3f} "
              f"{r['failed']:>7} {r['incomplete']:>6} {r['cpu_s']:>10.1f} {r['wall_s']:>7.1f}")
    if len(rows) > 1:
        print(f"CPU {rows[0]['variant']}/{rows[-1]['variant']}: {rows[0]['cpu_s'] / max(rows[-1]['cpu_s'], 1e-9):.2f}x, "
              f"median {'store' if args.stores else 'read'} {rows[0]['median_s'] / max(rows[-1]['median_s'], 1e-9):.2f}x, "
              f"p90 {rows[0]['p90_s'] / max(rows[-1]['p90_s'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
