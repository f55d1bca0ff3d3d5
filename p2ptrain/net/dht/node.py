"""SwarmDHT: the run's DHT records over a ``hivemind.DHT``, verified, under deadlines, refreshed, shut down
cleanly. The synchronous facade agents use (thread-safe)::

    with SwarmDHT("demo", DHTConfig(initial_peers=(bootstrap_maddr,))) as dht:
        maddrs = dht.get_visible_maddrs()
        dht.publish_peer(PeerRecord(device_name="H100", memory_gb=80.0, tflops=700.0, maddrs=tuple(maddrs)))
        peers = dht.read_peers()            # {peer_id: PeerRecord}: verified records only
        plan = select_plan(dht.read_plans(), peers)

* Identity: the RSA key that signs our entries is the libp2p identity of our p2pd (``identity.py``), so a
  reader derives the writer's peer ID from the entry's subkey. With ``identity_path`` the peer ID is stable
  across restarts (the file is created if missing); without it a fresh identity is made per start. p2pd
  reads the key from a private temporary copy (deleted once p2pd is up); its unique path also lets
  ``shutdown`` find a p2pd orphaned by a crashed DHT process.
* Validators: every node installs ``SignatureValidator(own key)`` (hivemind's RSA signatures, refusals logged)
  and ``SwarmRecordValidator`` (admission),
  and readers verify every entry (``validators.py``).
* Deadlines: every call to the DHT process waits at most ``request_timeout_s`` and then raises
  ``PeerTimeoutError``; start waits at most ``startup_timeout_s``; shutdown at most ``shutdown_timeout_s``
  per step.
* Expiration and refresh: a record expires ``*_ttl_s`` after it was stored. Published peer, links and plan
  records are re-stored every ``refresh_fraction`` of their TTL by a background thread until replaced,
  withdrawn or shut down. Progress records are not refreshed by default: a heartbeat must come from the
  training loop, or a hung agent would look alive.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.errors import ConfigError, PeerTimeoutError, ProtocolError
from p2ptrain.lifecycle import find_processes, shutdown_in_order, terminate_stray_process
from p2ptrain.net import p2p_fixes
from p2ptrain.net.dht import plan_store
from p2ptrain.net.dht.admission import AdmissionConfig, AdmissionPolicy, attach_token
from p2ptrain.net.dht.counters import DHTCounters, entry_bytes
from p2ptrain.net.dht.keys import RecordKind, RunKeys
from p2ptrain.net.dht.records import LinksRecord, PeerRecord, PlanRecord, ProgressRecord, Record
from p2ptrain.net.dht.refresh import Refresher
from p2ptrain.net.dht.relaying import RelayingDHT, dial_circuits
from p2ptrain.net.dht.row_history import RowHistory
from p2ptrain.net.dht.validators import (
    MAX_TTL_S,
    RateLimitedLog,
    SignatureValidator,
    SwarmRecordValidator,
    Verified,
    verify_entries,
)
from p2ptrain.net.identity import Identity, TemporaryIdentityFile, generate_identity, load_or_create_identity
from p2ptrain.net.nat.relay import RelayConfig, circuit_maddrs, is_circuit

p2p_fixes.apply()  # before any P2P client starts (the DHT's process, forked from ours, inherits it)

logger = logging.getLogger(__name__)

_REACH_HINT = "check that they are running and that their address, port and firewall let this machine in"
JOIN_PAUSE_S = 2.0  # between two tries to reach the initial peers (``join``)
# hivemind's DHTNode, as every p2ptrain node runs it: each key on its 5 nearest nodes (hivemind's default), and
# none of the caching that re-sends whole values: after each read hivemind stores the value found on the nearest
# node that lacked it, and re-reads values it served from its cache before they expire. A run's keys are each
# written by every peer and read with ``latest`` (all replicas merged), so those copies were a whole value sent
# per read, and no read was answered from them
NODE_OPTIONS: dict[str, Any] = {"num_replicas": 5, "cache_nearest": 0, "cache_refresh_before_expiry": 0}
# a store returns once the first of the replicas has it; the others get it in the background. hivemind waits for all
# five by default, so on a machine too loaded to answer in time the slowest of five decides whether a store "failed"
# and is sent to all five again (a 64-agent swarm on two cores: 92 % of its stores timed out, one agent's links row
# 157 times of 158). ``benchmarks/dht_load.py --stores`` (48 peers beside 24 busy processes) tells the two apart
# only within its noise.
STORE_OPTIONS: dict[str, Any] = {"await_all_replicas": False}


class BootstrapUnreachable(PeerTimeoutError):
    """None of the initial peers could be reached at start (``SwarmDHT.start``); ``join`` tries again."""


@dataclass(frozen=True)
class DHTConfig:
    """Where the DHT listens, whom it joins, how long records live, and every deadline (seconds)."""

    initial_peers: tuple[str, ...] = ()  # full multiaddrs ending in /p2p/<peer ID>, e.g. the bootstrap's
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()  # public addresses, when behind NAT / port forwarding
    identity_path: str | None = None  # stable peer ID; created if missing; None: a new identity per start
    # with identity_path: ask the initial peers first whether another process runs with it (hivemind's check: a
    # second p2pd that dials them, a few tenths of a second of CPU); off where the identity is known to be ours
    check_identity: bool = True
    client_mode: bool = False  # True: do not serve DHT requests (peers behind NAT that nobody can dial)
    relay: RelayConfig = field(default_factory=RelayConfig)  # circuit relays: serve them, or be reached through them
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # closed runs: who may take part
    peer_ttl_s: float = 60.0
    links_ttl_s: float = 300.0
    plan_ttl_s: float = 120.0
    progress_ttl_s: float = 30.0
    refresh_fraction: float = 0.5  # re-store owned records after this fraction of their TTL
    request_timeout_s: float = 10.0
    startup_timeout_s: float = 60.0
    shutdown_timeout_s: float = 10.0
    # an agent's first stores (its peer record, the copies it holds) tried again this long on a busy DHT
    # (``retrying``): 32 agents starting on 2 cores saw a store time out at 105 s, and the agent exited
    start_retry_s: float = 300.0
    # a read or a store visits this many of the nodes nearest its key (hivemind's beam; its default, 20, is every
    # node of a run of 20: each read of a key the whole run writes then asks every node, and each answers with its
    # copy of the whole value); the records live on the 5 nearest (``NODE_OPTIONS``)
    beam_size: int = 8

    def __post_init__(self) -> None:
        for name in ("peer_ttl_s", "links_ttl_s", "plan_ttl_s", "progress_ttl_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_TTL_S:
                raise ConfigError(f"{name}={value} must be in (0, {MAX_TTL_S:.0f}]")
        for name in ("request_timeout_s", "startup_timeout_s", "shutdown_timeout_s", "start_retry_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if not 0 < self.refresh_fraction < 1:
            raise ConfigError(f"refresh_fraction={self.refresh_fraction} must be in (0, 1)")
        if not NODE_OPTIONS["num_replicas"] <= self.beam_size <= 64:
            raise ConfigError(f"beam_size={self.beam_size} must be in [{NODE_OPTIONS['num_replicas']}, 64]: "
                              "a search must reach every node that holds a key")
        if not self.host_maddrs:
            raise ConfigError("host_maddrs is empty: give at least one address to listen on")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for maddr in getattr(self, name):
                _check_maddr(name, maddr, need_peer_id=name == "initial_peers")

    def ttl_s(self, kind: RecordKind) -> float:
        return {
            RecordKind.PEER: self.peer_ttl_s, RecordKind.LINKS: self.links_ttl_s,
            RecordKind.PLAN: self.plan_ttl_s, RecordKind.PROGRESS: self.progress_ttl_s,
        }[kind]


class SwarmDHT:
    """A DHT peer of one run (``run_id``), or a DHT-only peer (``run_id=None``, the bootstrap).

    ``admission_run_ids``: further runs whose keys this node checks at admission (a bootstrap serving them).
    """

    def __init__(
        self, run_id: str | None, config: DHTConfig | None = None, *, admission_run_ids: Iterable[str] = ()
    ):
        self.config = config or DHTConfig()
        self.keys = RunKeys(run_id) if run_id is not None else None
        self._admission_runs = tuple(dict.fromkeys(([run_id] if run_id else []) + list(admission_run_ids)))
        for run in self._admission_runs:
            RunKeys(run)  # validates the run ID
        self._policies = {run: AdmissionPolicy(run, self.config.admission) for run in self._admission_runs}
        self._token = self.config.admission.token_bytes()
        self._admitted_by_token: set[str] = set()  # writers whose records carried a valid token
        self._relay_dials: dict[str, float] = {}  # peer: when we last dialled it through a relay
        self._relay_dial_future: Any = None
        # told every peer record read (``forward.Routes.update``: who is behind NAT, through which relay)
        self.peer_listeners: list[Callable[[dict[str, tuple[str, ...]]], None]] = []
        self.plan_listeners: list[Callable[[int], None]] = []  # told the epoch of each plan we publish
        self._identity: Identity | None = None
        self._dht: hivemind.DHT | None = None
        self._p2pd_marker: bytes | None = None
        self._pipe_lock = threading.Lock()  # the DHT's pipe is not safe for concurrent senders
        self._refresher = Refresher(
            self._store, lambda kind: self.config.ttl_s(kind) * self.config.refresh_fraction
        )
        self._log = RateLimitedLog(logging.getLogger("p2ptrain.net.dht.validators"))
        self._plans = plan_store.PlanReader(self._log)  # plans assembled from their parts, by digest
        self._atexit_hook: Callable[[], None] | None = None
        self._closed = False
        self.counters = DHTCounters()
        self.rows_read = RowHistory()  # the links rows read lately, by version: a plan is checked on its leader's
        self._store_s: collections.deque[float] = collections.deque(maxlen=16)  # our last stores' seconds
        self.node_options, self.store_options = dict(NODE_OPTIONS), dict(STORE_OPTIONS)  # ``dht_load.py`` varies them

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> SwarmDHT:
        """Start the DHT process and p2pd, join ``initial_peers``; raises within ``startup_timeout_s``."""
        cfg = self.config
        path = cfg.identity_path
        self._identity = load_or_create_identity(path) if path else generate_identity()
        key_file = TemporaryIdentityFile(self._identity)
        self._p2pd_marker = b"-id=" + key_file.path.encode() + b"\0"
        validators = self._record_validators(self._identity)
        self._atexit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._atexit_hook)
        logger.info("starting DHT peer %s on %s", self._identity.peer_id, ", ".join(cfg.host_maddrs))
        try:
            # hivemind's check that an identity is free starts a second daemon with it and connects it to
            # the initial peers: a relay then briefly knows two connections of one private peer and drops
            # circuits to it, so a private peer skips the check (its identity file is its own)
            self._dht = RelayingDHT(
                cfg.relay.p2pd_extra_args(cfg.initial_peers), **cfg.relay.p2p_kwargs(cfg.initial_peers),
                initial_peers=list(cfg.initial_peers) or None, start=False, record_validators=validators,
                shutdown_timeout=cfg.shutdown_timeout_s, host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=list(cfg.announce_maddrs) or None, identity_path=key_file.path,
                check_if_identity_free=bool(path) and cfg.check_identity and cfg.relay.reachability != "private", client_mode=cfg.client_mode,
                nat_port_map=not _loopback_only(cfg.host_maddrs),  # UPnP for 127.0.0.1: 0.3 s of p2pd's CPU for nothing
                startup_timeout=cfg.startup_timeout_s, ensure_bootstrap_success=False, **self.node_options,
            )
            self._dht.run_in_background(await_ready=True, timeout=cfg.startup_timeout_s)
            peer_id, routing_table_size = self._call(_node_status, "startup check")
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise PeerTimeoutError(
                f"the DHT did not start within startup_timeout_s={cfg.startup_timeout_s}"
            ) from None
        except (ProtocolError, ConfigError):
            self.shutdown()
            raise
        except Exception as e:  # hivemind and p2pd fail in many ways: one error type that names the peer
            self.shutdown()
            hint = (
                f" (initial peers: {' '.join(cfg.initial_peers)}; {_REACH_HINT})" if cfg.initial_peers else ""
            )
            who = f"peer {self._identity.peer_id}" + (f" (identity file {path})" if path else "")
            error = BootstrapUnreachable if "failed to connect to bootstrap" in str(e) else ProtocolError
            raise error(f"could not start DHT {who}: {type(e).__name__}: {e}{hint}") from e
        except BaseException:  # KeyboardInterrupt during startup: stop what started, then let it through
            self.shutdown()
            raise
        finally:
            key_file.close()
        if peer_id != self._identity.peer_id:  # the signing key must be p2pd's identity (see identity.py)
            self.shutdown()
            raise RuntimeError(f"p2pd runs as {peer_id}, expected {self._identity.peer_id}")
        if cfg.initial_peers and routing_table_size == 0:
            self.shutdown()
            raise BootstrapUnreachable(
                f"none of the initial peers answered: {' '.join(cfg.initial_peers)}; {_REACH_HINT}"
            )
        self._refresher.start()
        logger.info("DHT peer %s is up (%d peers in its routing table)", peer_id, routing_table_size)
        return self

    @classmethod
    def join(cls, run_id: str | None, config: DHTConfig, stopped: Callable[[], bool] = lambda: False,
             pause_s: float = JOIN_PAUSE_S, **kwargs: Any) -> SwarmDHT:
        """A started node (``start``), tried again while none of the initial peers can be reached, until
        ``DHTConfig.startup_timeout_s`` from now: a volunteer whose bootstrap is not up yet, or whose home network
        blinked, joins once it can (under load one of two home volunteers found its NAT path closed for a
        moment and exited). Each try logs why it failed; ``stopped`` ends the tries (a signal)."""
        deadline, tries = time.monotonic() + config.startup_timeout_s, 0
        while True:
            tries += 1
            try:
                return cls(run_id, config, **kwargs).start()
            except BootstrapUnreachable as e:
                left = deadline - time.monotonic()
                if left <= pause_s or stopped():
                    raise
                logger.warning("try %d to join the swarm failed (%s); trying again in %.0f s (%.0f s left)", tries,
                               e, pause_s, left)
                time.sleep(pause_s)

    def _record_validators(self, identity: Identity) -> list[RecordValidatorBase]:
        """What this node signs and admits with (tests subclass this to build a rogue node)."""
        return [SignatureValidator(identity.private_key, self._admission_runs),
                SwarmRecordValidator(self._admission_runs, self._policies)]

    def shutdown(self) -> None:
        """Stop refreshing, stop the DHT process and p2pd; idempotent, bounded by ``shutdown_timeout_s``."""
        if self._closed:
            return
        self._closed = True
        if self._atexit_hook is not None:
            atexit.unregister(self._atexit_hook)
        timeout_s = self.config.shutdown_timeout_s
        shutdown_in_order([
            ("stop refresher", lambda: self._refresher.stop(timeout_s)),
            ("stop DHT process", self._stop_dht_process),
            ("reap p2pd", self._reap_p2pd),
        ])
        logger.info("DHT peer %s shut down", self.peer_id if self._identity else "(not started)")

    def __enter__(self) -> SwarmDHT:
        return self if self._dht is not None else self.start()  # ``with SwarmDHT.join(...) as dht``: started

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _stop_dht_process(self) -> None:
        dht = self._dht
        if dht is None or dht.pid is None:
            return
        if dht.is_alive():
            dht.shutdown()  # graceful; hivemind SIGTERMs it after shutdown_timeout
        dht.join(self.config.shutdown_timeout_s)
        if dht.is_alive():
            logger.warning("DHT process %d ignored SIGTERM; killing it", dht.pid)
            dht.kill()
            dht.join(self.config.shutdown_timeout_s)

    def _reap_p2pd(self) -> None:
        if self._p2pd_marker is not None:
            for pid in find_processes("p2pd", self._p2pd_marker):
                terminate_stray_process(pid, "p2pd", self.config.shutdown_timeout_s / 2)

    # ---- identity and addresses ------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        if self._identity is None:
            raise RuntimeError("SwarmDHT is not started")
        return self._identity.peer_id

    @property
    def signing_key(self) -> RSAPrivateKey:
        """This peer's identity key (its peer ID is its hash): it signs the peer's statements and records."""
        if self._identity is None:
            raise RuntimeError("the DHT is not started")
        return self._identity.private_key

    @property
    def hivemind_dht(self) -> hivemind.DHT:
        """The underlying DHT (e.g. ``await dht.hivemind_dht.replicate_p2p()`` for the tensor transport)."""
        if self._dht is None:
            raise RuntimeError("SwarmDHT is not started")
        return self._dht

    def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        """Our full multiaddrs (ending in ``/p2p/<peer ID>``): circuit addresses through our relays first (a
        peer behind NAT is reachable only there), then the others, loopback last."""
        found = self._call(functools.partial(_visible_maddrs, latest=latest), "get_visible_maddrs")
        maddrs = [str(m) for m in found]
        circuits = circuit_maddrs(self.config.relay.relays_for(self.config.initial_peers), self.peer_id)
        return circuits + sorted(maddrs, key=lambda m: m.startswith(("/ip4/127.", "/ip6/::1/")))

    def dial_through_relays(self, records: dict[str, PeerRecord]) -> None:
        """Open a connection through a relay to every peer of ``records`` that advertises circuit addresses
        and is not connected yet, in the background (the DHT process; each dial under ``request_timeout_s``).
        A public peer dials none (they dial it); of two private peers, the one with the lower ID dials.

        The transport dials peers by their record's addresses but hands p2pd only the transport part of
        each (``Transport.connect``), which for a circuit address is the relay itself; once a connection
        through the relay is open, that dial finds it and succeeds.
        """
        if self.config.relay.reachability == "public":
            return  # peers behind NAT dial us directly
        now = time.monotonic()
        retry_s = self.config.relay.redial_s
        # Of two peers behind NAT, only the lower ID dials: circuits opened both ways at once get reset
        targets = {
            peer: tuple(m for m in record.maddrs if is_circuit(m))
            for peer, record in records.items()
            if peer > self.peer_id and any(is_circuit(m) for m in record.maddrs)
            and now - self._relay_dials.get(peer, -retry_s) >= retry_s
        }
        if targets:
            self._relay_dials.update(dict.fromkeys(targets, now))
            timeout_s = self.config.request_timeout_s
            with self._pipe_lock:  # kept: a dropped future would cancel the dials
                self._relay_dial_future = self.hivemind_dht.run_coroutine(
                    functools.partial(dial_circuits, targets=targets, timeout_s=timeout_s), return_future=True
                )

    def routing_table_size(self) -> int:
        """How many other DHT peers this node knows (for health logs)."""
        return self._call(_node_status, "routing table size")[1]

    # ---- publish ---------------------------------------------------------------------------------------

    def publish(self, record: Record, *, refresh: bool = True) -> bool:
        """Store ``record`` under our subkey of its kind's key, on the ``num_replicas`` nodes nearest the key.

        Returns hivemind's status, which is that of the *last* replica to answer (hivemind 1.1.12
        ``DHTNode.store_many`` overwrites it per reply): True means at least that node stored it; False
        means no node answered, or the last one refused (a rogue or stale node can cause this while others
        stored it). Read it back when it matters. Raises RecordTooLarge if it does not fit a DHT value,
        PeerTimeoutError past ``request_timeout_s``.
        With ``refresh``, it is re-stored before it expires until replaced, ``withdraw``n or shut down.
        """
        return self._refresher.publish(record, refresh)

    def publish_peer(self, record: PeerRecord) -> bool:
        return self.publish(record)

    def publish_links(self, record: LinksRecord) -> bool:
        return self.publish(record)

    def publish_plan(self, record: PlanRecord) -> bool:  # the ``plan_listeners`` told its epoch (the heartbeats say it)
        stored = self.publish(record)
        for listener in self.plan_listeners:
            listener(record.epoch)
        return stored

    def publish_progress(self, record: ProgressRecord, *, refresh: bool = False) -> bool:
        return self.publish(record, refresh=refresh)

    def withdraw(self, kind: RecordKind) -> None:
        """Stop refreshing our record of ``kind``; it disappears when it expires (a DHT cannot delete)."""
        self._refresher.withdraw(kind)

    def _store(self, kind: RecordKind, record: Record) -> bool:
        if kind is RecordKind.PLAN:  # its parts first, then the head that names them (``plan_store``)
            head, parts = plan_store.split(record)  # type: ignore[arg-type]
            # the parts at once: one after another, a 32-agent run's leader took 15 s to store its plan
            stored = self._store_values(kind, [(self.keys.plan_part(p.index), p.encode()) for p in parts])  # type: ignore[union-attr]
            return self._store_values(kind, [(self._key(kind), head.encode())])[0] and all(stored)
        return self._store_values(kind, [(self._key(kind), record.encode())])[0]

    def _store_values(self, kind: RecordKind, values: list[tuple[str, bytes]]) -> list[bool]:
        """Store each (key, value) under our subkey, all sent at once; whether each was stored (``publish``)."""
        expiration_time = get_dht_time() + self.config.ttl_s(kind)
        if self._token is not None:  # a closed run: our records show our join token (admission.py)
            values = [(key, attach_token(value, self._token)) for key, value in values]
        started = time.monotonic()
        results = [False] * len(values)
        try:
            self._check_running(f"store of {values[0][0]}")
            options = dict(subkey=self._identity.owner_mark, beam_size=self.config.beam_size, **self.store_options)
            with self._pipe_lock:
                futures = [self.hivemind_dht.store(key, value, expiration_time, return_future=True, **options)
                           for key, value in values]
            for i, ((key, _), future) in enumerate(zip(values, futures, strict=True)):
                results[i] = bool(self._result(future, f"store of {key}"))
        finally:
            self._store_s.append(time.monotonic() - started)
            self.counters.add(kind, stores=len(values), store_bytes=sum(len(v) for _, v in values),
                              store_failures=results.count(False), seconds=time.monotonic() - started)
        for (key, _), ok in zip(values, results, strict=True):
            if not ok:
                self._log.warning(
                    (key, "store"),
                    "DHT store of our %s record got no acceptance from the first replica "
                    "to answer (or none answered); other replicas may hold it",
                    key,
                )
        return results

    def slowest_store_s(self) -> float:
        """The slowest of our last 16 stores, in seconds (0 before any): what a peer's publishing takes now."""
        return max(self._store_s, default=0.0)

    # ---- read ------------------------------------------------------------------------------------------

    def read(self, kind: RecordKind) -> dict[str, Verified[Record]]:
        """Every verified, unexpired record of ``kind``, by writer's peer ID (invalid ones are logged); plans
        from their heads and, for a plan not read before, its parts (``plan_store``)."""
        key = self._key(kind)
        (found,) = self._get(kind, [key])
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            self._log.warning(
                (key, "not-a-dict"), "ignoring %s: it holds a plain value, not per-peer entries", key
            )
            return {}
        now = get_dht_time()
        policy = self._policies.get(self.keys.run_id)
        if kind is RecordKind.PLAN:
            def parts(indices: Iterable[int]) -> dict[int, Any]:
                got = self._get(kind, [self.keys.plan_part(i) for i in indices])
                return {i: g.value for i, g in zip(indices, got, strict=True) if g is not None and isinstance(g.value, dict)}
            verified: dict[str, Verified[Any]] = self._plans.read(found.value, parts, now, policy)
        else:
            verified = {p: v for p, v in verify_entries(kind, found.value, self._log, policy).items()
                        if v.expiration_time > now}
        if policy is not None and policy.closed:
            self._admitted_by_token.update(verified)
        return verified

    def _get(self, kind: RecordKind, keys: list[str]) -> list[Any]:
        """What the DHT holds under each of ``keys`` (None where nothing), asked at once, each counted."""
        started, failed, found = time.monotonic(), True, [None] * len(keys)
        try:
            self._check_running(f"get of {keys[0]}")
            with self._pipe_lock:
                futures = [self.hivemind_dht.get(key, latest=True, return_future=True, beam_size=self.config.beam_size)
                           for key in keys]
            found = [self._result(future, f"get of {key}") for key, future in zip(keys, futures, strict=True)]
            failed = False
        finally:
            self.counters.add(kind, reads=len(keys), read_bytes=sum(entry_bytes(f) for f in found),
                              read_failures=len(keys) if failed else 0, seconds=time.monotonic() - started)
        return found

    def is_admitted(self, peer_id: str) -> bool:
        """May ``peer_id`` take part in our run: always in an open run; in a closed one, if it is listed or
        a record of its with a valid join token was read (the transport's ``Mailbox.admit_sender``)."""
        policy = self._policies.get(self.keys.run_id) if self.keys is not None else None
        if policy is None or not policy.closed:
            return True
        return policy.refusal(peer_id, None) is None or peer_id in self._admitted_by_token

    def read_peers(self) -> dict[str, PeerRecord]:
        """Verified peer records; peers reachable only through a relay are dialled through it (see
        ``dial_through_relays``) so that the transport can reach them."""
        peers = {p: v.record for p, v in self.read(RecordKind.PEER).items()}
        self.dial_through_relays(peers)  # type: ignore[arg-type]
        for listener in self.peer_listeners:
            listener({peer: tuple(record.maddrs) for peer, record in peers.items()})  # type: ignore[attr-defined]
        return peers  # type: ignore[return-value]

    def read_links(self) -> dict[str, LinksRecord]:
        """The run's links rows by writer; each one read is also kept by version (``row_history``)."""
        rows = {p: v.record for p, v in self.read(RecordKind.LINKS).items()}
        self.rows_read.note(rows)  # type: ignore[arg-type]
        return rows  # type: ignore[return-value]

    def read_plans(self) -> dict[str, PlanRecord]:
        """Plans by signer; each is signed by the leader it names (pick one with ``election.select_plan``)."""
        return {p: v.record for p, v in self.read(RecordKind.PLAN).items()}  # type: ignore[misc]

    def read_progress(self) -> dict[str, ProgressRecord]:
        return {p: v.record for p, v in self.read(RecordKind.PROGRESS).items()}  # type: ignore[misc]

    # ---- plumbing --------------------------------------------------------------------------------------

    def _key(self, kind: RecordKind) -> str:
        if self.keys is None:
            raise RuntimeError("this SwarmDHT has no run (a DHT-only peer publishes and reads no records)")
        return self.keys.of(kind)

    def _check_running(self, what: str) -> None:
        """ProtocolError once shut down (the DHT process's pipe is closed: a call would raise OSError)."""
        if self._closed or self._dht is None or not self._dht.is_alive():
            raise ProtocolError(f"DHT {what}: the DHT process is not running")

    def _call(self, coroutine: Callable[..., Any], what: str) -> Any:
        self._check_running(what)
        with self._pipe_lock:
            future = self.hivemind_dht.run_coroutine(coroutine, return_future=True)
        return self._result(future, what)

    def _result(self, future: Any, what: str) -> Any:
        if self._closed or not self.hivemind_dht.is_alive():
            future.cancel()
            raise ProtocolError(f"DHT {what}: the DHT process is not running")
        try:
            return future.result(timeout=self.config.request_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise PeerTimeoutError(
                f"DHT {what} did not finish within request_timeout_s={self.config.request_timeout_s}"
            ) from None


async def _node_status(_dht: hivemind.DHT, node: Any) -> tuple[str, int]:
    return node.peer_id.to_base58(), len(node.protocol.routing_table.uid_to_peer_id)


async def _visible_maddrs(_dht: hivemind.DHT, node: Any, latest: bool) -> list[Any]:
    return await node.get_visible_maddrs(latest=latest)


def _shutdown_at_exit(ref: weakref.ReferenceType[SwarmDHT]) -> None:
    dht = ref()
    if dht is not None:
        dht.shutdown()


def _loopback_only(maddrs: tuple[str, ...]) -> bool:
    return all(m.startswith(("/ip4/127.", "/ip6/::1/")) for m in maddrs)


def _check_maddr(name: str, maddr: str, need_peer_id: bool) -> None:
    try:
        parsed = Multiaddr(maddr)
    except Exception:  # the multiaddr parser raises several types
        raise ConfigError(f"{name}: {maddr!r} is not a multiaddr (like /ip4/203.0.113.7/tcp/31337)") from None
    if need_peer_id and "p2p" not in parsed:
        raise ConfigError(f"{name}: {maddr} lacks /p2p/<peer ID>; copy the whole line the bootstrap printed")
