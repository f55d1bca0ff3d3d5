"""A worker process of ``p2ptrain train --stages S --replicas D``: one (stage, replica) of a fixed plan.

Run by the launcher, one process per role::

    python -m p2ptrain.runtime.worker SPEC.json

The worker joins the run's DHT through the launcher's bootstrap peer, announces which role it holds under
``{run}.workers``, waits (under a deadline) until every role is announced, builds its stage from the seed,
and trains with the real runtime: GPipe over libp2p to its pipeline neighbours, the sharded all-reduce with
its replica group. It appends one JSON line per event to its progress file (the launcher's only window into
it) and exits 0 once every step is done; on any error it logs the reason and exits 1. SIGTERM and SIGINT
stop it cleanly (transport and DHT shut down, nothing left running).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch

from p2ptrain.config import config_from_dict
from p2ptrain.net.transport.emulation import EmulationConfig, LinkEmulator
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import resolve_device, torch_settings
from p2ptrain.runtime.session import StageTrainer
from p2ptrain.runtime.topology import Role, Topology

logger = logging.getLogger(__name__)

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@dataclass(frozen=True)
class LinkMatrices:
    """An emulated network: device ``device_of_role[f"{stage}/{replica}"]`` of these matrices per role."""

    latency_ms: tuple[tuple[float, ...], ...]
    bandwidth_gbps: tuple[tuple[float, ...], ...]
    device_of_role: dict[str, int]
    emulation: EmulationConfig = EmulationConfig()
    uplink_gbps: tuple[float | None, ...] | None = None  # each device's access link (None: unlimited)
    downlink_gbps: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class WorkerSpec:
    run: str
    stage: int
    replica: int
    initial_peers: tuple[str, ...]
    train: TrainConfig
    progress_path: str
    state_path: str | None = None  # where to save the stage's final parameters (torch.save)
    check_replicas: bool = True  # publish a digest of the parameters after every step
    rendezvous_timeout_s: float = 120.0
    call_timeout_s: float = 60.0  # deadline of every send and receive of a step
    record_ttl_s: float = 600.0
    links: LinkMatrices | None = None

    @property
    def role_key(self) -> str:
        return f"{self.stage}/{self.replica}"


def workers_key(run: str) -> str:
    return f"{run}.workers"


def params_digest(module: torch.nn.Module) -> str:
    """A digest of the parameters' bytes: replicas of a stage must agree bit for bit."""
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def anchor_digest(anchor: list[torch.Tensor]) -> str:
    """A digest of DiLoCo's anchor (``model.outer``), the same on every replica of a stage."""
    h = hashlib.sha256()
    for tensor in anchor:
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ProgressWriter:
    def __init__(self, path: str):
        self.path = Path(path)

    def write(self, **event) -> None:
        event.setdefault("time", time.time())
        with self.path.open("a") as f:
            f.write(json.dumps(event) + "\n")


def rendezvous(dht: hivemind.DHT, spec: WorkerSpec, peer_id: str, maddrs: list[str]) -> tuple[Topology, dict[str, list[str]]]:
    """Announce our role and addresses, and wait until all S × D roles are announced.

    Returns the plan's table of peer IDs and every peer's multiaddrs (dialling a peer by address is
    immediate; finding it by ID through libp2p's routing can stall).
    """
    cfg = spec.train
    key = workers_key(spec.run)
    deadline = time.monotonic() + spec.rendezvous_timeout_s
    expiration = hivemind.utils.get_dht_time() + spec.record_ttl_s
    announcement = {"peer": peer_id, "maddrs": maddrs}
    if not dht.store(key, announcement, expiration, subkey=spec.role_key):
        logger.warning("the DHT did not confirm storing our role; will retry while waiting")
    wanted = {f"{s}/{r}" for s in range(cfg.stages) for r in range(cfg.replicas)}
    seen: dict[str, dict] = {}
    while True:
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict):
            seen = {
                sub: item.value
                for sub, item in found.value.items()
                if sub in wanted and _is_announcement(item.value)
            }
        if seen.keys() == wanted:
            break
        if time.monotonic() > deadline:
            missing = sorted(wanted - seen.keys())
            raise TimeoutError(f"rendezvous: roles {', '.join(missing)} not announced within {spec.rendezvous_timeout_s:.0f} s")
        if spec.role_key not in seen:
            dht.store(key, announcement, expiration, subkey=spec.role_key)
        time.sleep(0.2)
    rows = [[seen[f"{s}/{r}"]["peer"] for s in range(cfg.stages)] for r in range(cfg.replicas)]
    return Topology.from_rows(rows), {a["peer"]: list(a["maddrs"]) for a in seen.values()}


def _is_announcement(value: object) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("peer"), str)
        and isinstance(value.get("maddrs"), list)
        and all(isinstance(m, str) for m in value["maddrs"])
    )


def run_worker(spec: WorkerSpec) -> None:
    progress = ProgressWriter(spec.progress_path)
    cfg = spec.train
    device = resolve_device(cfg.device)
    dht = hivemind.DHT(initial_peers=list(spec.initial_peers), host_maddrs=list(LOOPBACK), start=True)
    transport = None
    try:
        emulator = LinkEmulator()
        # DiLoCo: pipelines drift apart within a round, up to H - 1 steps, and a round's end waits for the slowest
        window = max(TransportConfig.step_window, cfg.diloco.step_window if cfg.sync == "diloco" else 0)
        transport = Transport(spec.run, TransportConfig(call_timeout_s=spec.call_timeout_s, step_window=window),
                              dht=dht, emulator=emulator)
        peer_id = str(transport.peer_id)
        topology, maddrs = rendezvous(dht, spec, peer_id, transport.visible_maddrs)
        for peer in topology.neighbours(topology.role_of(peer_id)):
            transport.connect(peer, maddrs[peer], spec.call_timeout_s)  # dialling by ID alone can stall
        role = topology.role_of(peer_id)
        assert (role.stage, role.replica) == (spec.stage, spec.replica)
        if spec.links is not None:
            _emulate(emulator, spec.links, topology, peer_id)
        progress.write(event="ready", peer=peer_id, stage=role.stage, replica=role.replica)
        logger.info("stage %d replica %d as peer %s; plan %d×%d", role.stage, role.replica, peer_id,
                    role.num_stages, role.num_replicas)
        with torch_settings(cfg.num_threads, cfg.deterministic):
            _train(spec, role, topology, transport, progress, device)
        _finish_together(dht, spec, topology, role)
        progress.write(event="done")
    finally:
        if transport is not None:
            transport.shutdown()
        dht.shutdown()


def _finish_together(dht: hivemind.DHT, spec: WorkerSpec, topology: Topology, role: Role) -> None:
    """Stay up until every peer we exchange tensors with has finished too.

    A receiver that has all it needs may finish its last step while the reply acknowledging our last
    message is still on its way; if it shut its daemon down at once, our send would fail. Each worker says
    it is done (all its sends acknowledged) and leaves once its neighbours have said so, or after a deadline.
    """
    key = f"{spec.run}.done"
    dht.store(key, True, hivemind.utils.get_dht_time() + spec.record_ttl_s, subkey=spec.role_key)
    waiting_for = {f"{topology.role_of(p).stage}/{topology.role_of(p).replica}" for p in topology.neighbours(role)}
    deadline = time.monotonic() + spec.call_timeout_s
    while waiting_for and time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict):
            waiting_for -= set(found.value)
        if waiting_for:
            time.sleep(0.1)
    if waiting_for:
        logger.warning("leaving before %s said they were done", ", ".join(sorted(waiting_for)))


def _emulate(emulator: LinkEmulator, links: LinkMatrices, topology: Topology, me: str) -> None:
    """Shape our outgoing links as device ``device_of_role[our role]`` of the matrices."""
    peers = [""] * len(links.latency_ms)
    for key, device in links.device_of_role.items():
        stage, replica = map(int, key.split("/"))
        peers[device] = topology.holder(stage, replica)
    if "" in peers:
        raise ValueError(f"the emulated network has {len(peers)} devices but the plan only {len(topology.peers)} roles")
    emulator.set_links_from_matrices(peers, peers.index(me), links.latency_ms, links.bandwidth_gbps, links.emulation,
                                     links.uplink_gbps, links.downlink_gbps)


def _train(spec: WorkerSpec, role: Role, topology: Topology, transport: Transport, progress, device) -> None:
    cfg = spec.train
    trainer = StageTrainer(cfg, role, device)
    for step in range(cfg.steps):
        result = trainer.step(transport, spec.run, 0, step, topology, spec.call_timeout_s)
        event = {"event": "step", "step": step, "step_time_s": result.step_time_s,
                 "peak_activation_bytes": result.peak_activation_bytes, "peak_in_flight": result.peak_in_flight}
        if result.loss is not None:
            event["loss"] = result.loss
        if spec.check_replicas:  # with DiLoCo's ``overlap`` replicas start rounds apart: their anchors agree
            outer = trainer.executor.outer
            event["digest"] = (params_digest(trainer.module)
                               if outer is None or not (cfg.diloco.overlap or cfg.diloco.fragments > 1)
                               else anchor_digest(outer.anchor))
        progress.write(**event)
        if result.loss is not None and role.replica == 0:
            logger.info("step %d/%d loss %.4f (%.3f s)", step + 1, cfg.steps, result.loss, result.step_time_s)
    if spec.state_path:
        torch.save({k: v.detach().cpu() for k, v in trainer.module.state_dict().items()}, spec.state_path)


def load_spec(path: str) -> WorkerSpec:
    data = json.loads(Path(path).read_text())
    return config_from_dict(WorkerSpec, data)


def spec_to_dict(spec: WorkerSpec) -> dict:
    return dataclasses.asdict(spec)


def _stop(signum, frame):  # SIGTERM/SIGINT: unwind through the finally blocks that shut everything down
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    spec = load_spec(argv[0])
    try:
        run_worker(spec)
    except SystemExit:
        raise
    except Exception as e:
        logger.error("worker %s failed: %s", spec.role_key, e, exc_info=logger.isEnabledFor(logging.DEBUG))
        ProgressWriter(spec.progress_path).write(event="error", error=f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
