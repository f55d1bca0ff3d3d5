"""``p2ptrain train --stages S --replicas D``: S × D worker processes on loopback, the real runtime.

The launcher starts a DHT peer in this process as the bootstrap, writes one spec per role, starts one
worker process per role (each in its own session, see ``procgroup``), and follows their progress files.
It returns the losses reported by the last stage, the step times, and whether every stage's replicas held
bit-identical parameters after every step. Every wait has a deadline; on any failure, Ctrl-C or SIGTERM,
every worker (and its DHT process and libp2p daemon) is stopped and reaped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import hivemind

from p2ptrain.model.compiled import check_compile
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.procgroup import ChildFailed, ProcessGroup, tail
from p2ptrain.runtime.reference import StepReport, resolve_device
from p2ptrain.runtime.worker import LOOPBACK, LinkMatrices, WorkerSpec

logger = logging.getLogger(__name__)

# What a worker imports, and the parts of torch its optimizer and deterministic mode load on first use:
# the workers are forked from one process that imported them once (``runtime.forkserver``).
WORKER_MODULES = ("p2ptrain.runtime.worker", "torch._dynamo", "torch._inductor.config")

@dataclass(frozen=True)
class LaunchConfig:
    """Deadlines of a local distributed run (seconds)."""

    startup_timeout_s: float = 180.0  # from launch until every worker has joined
    step_timeout_s: float = 120.0  # longest wait for the next step to complete
    call_timeout_s: float = 60.0  # every send/receive inside a step
    check_replicas: bool = True


class ReplicaMismatch(RuntimeError):
    """Replicas of a stage held different parameters after a step: exactness is broken."""


@dataclass
class DistributedResult:
    losses: list[float]
    step_time_s: list[float]
    replicas_identical: bool  # checked after every step (a mismatch raises ReplicaMismatch)
    workdir: str
    peers: dict[str, str] = field(default_factory=dict)  # "stage/replica" -> peer ID


class _Follower:
    """Reads the workers' progress files incrementally."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = paths
        self.offsets = dict.fromkeys(paths, 0)
        self.events: dict[str, list[dict]] = {key: [] for key in paths}

    def poll(self) -> list[tuple[str, dict]]:
        new = []
        for key, path in self.paths.items():
            if not path.exists():
                continue
            with path.open() as f:
                f.seek(self.offsets[key])
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[key] += len(complete)
            for line in complete.splitlines():
                event = json.loads(line)
                self.events[key].append(event)
                new.append((key, event))
        return new

    def steps(self, key: str) -> list[dict]:
        return [e for e in self.events[key] if e.get("event") == "step"]


def train_distributed(
    cfg: TrainConfig,
    *,
    launch: LaunchConfig | None = None,
    workdir: str | None = None,
    links: LinkMatrices | None = None,
    save_states: bool = False,
    on_step: Callable[[StepReport], None] | None = None,
) -> DistributedResult:
    """Train ``cfg`` on ``cfg.stages`` × ``cfg.replicas`` worker processes (Megatron's rank order)."""
    if cfg.compile:  # torch cannot compile here: one line before any worker starts
        check_compile(resolve_device(cfg.device))
    launch = launch or LaunchConfig()
    own_workdir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="p2ptrain-train-") if own_workdir else workdir)
    root.mkdir(parents=True, exist_ok=True)
    run = f"train-{uuid.uuid4().hex[:8]}"
    roles = [(s, r) for r in range(cfg.replicas) for s in range(cfg.stages)]
    keys = [f"{s}/{r}" for s, r in roles]
    paths = {key: root / f"worker-{key.replace('/', '-')}.progress.jsonl" for key in keys}
    follower = _Follower(paths)
    group = ProcessGroup()
    group.use_fork_server(WORKER_MODULES, log_path=root / "forkserver.log")  # it imports while the DHT starts
    try:
        bootstrap = hivemind.DHT(host_maddrs=list(LOOPBACK), start=True)
    except BaseException:
        group.stop_all()
        raise
    try:
        initial_peers = tuple(str(a) for a in bootstrap.get_visible_maddrs())
        with group:
            for (stage, replica), key in zip(roles, keys, strict=False):
                name = f"worker-{stage}-{replica}"
                spec = WorkerSpec(
                    run=run, stage=stage, replica=replica, initial_peers=initial_peers, train=cfg,
                    progress_path=str(paths[key]),
                    state_path=str(root / f"{name}.state.pt") if save_states else None,
                    check_replicas=launch.check_replicas, rendezvous_timeout_s=launch.startup_timeout_s,
                    call_timeout_s=launch.call_timeout_s, links=links,
                )
                spec_path = root / f"{name}.spec.json"
                spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
                group.start(name, [sys.executable, "-m", "p2ptrain.runtime.worker", str(spec_path)],
                            log_path=root / f"{name}.log", fork=True)
            logger.info("started %d workers (%d stages × %d replicas); logs in %s",
                        len(roles), cfg.stages, cfg.replicas, root)
            result = _follow(cfg, launch, group, follower, keys, on_step)
            group.wait_all(deadline_s=launch.step_timeout_s)
        result.workdir = str(root)
        return result
    except ChildFailed as e:
        key = e.name.removeprefix("worker-").replace("-", "/")
        errors = [ev["error"] for ev in follower.events.get(key, []) if ev.get("event") == "error"]
        detail = errors[-1] if errors else tail(e.log_path, 5)
        raise RuntimeError(f"{e}: {detail}") from None
    finally:
        bootstrap.shutdown()
        if own_workdir and not save_states:
            shutil.rmtree(root, ignore_errors=True)


def _follow(cfg, launch, group, follower, keys, on_step) -> DistributedResult:
    last_key = f"{cfg.stages - 1}/0"
    reported = 0
    deadline = time.monotonic() + launch.startup_timeout_s
    while reported < cfg.steps:
        for key, event in follower.poll():
            if event.get("event") == "error":
                raise RuntimeError(f"worker {key} failed: {event.get('error')}")
            if key == last_key and event.get("event") == "step":
                reported += 1
                deadline = time.monotonic() + launch.step_timeout_s
                if on_step is not None:
                    on_step(StepReport(step=event["step"], loss=event["loss"], step_time_s=event["step_time_s"]))
        failed = group.failed()
        if failed:
            raise ChildFailed(failed[0].name, failed[0].poll(), failed[0].log_path)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step completed within {launch.step_timeout_s:.0f} s (after {reported} steps)")
        time.sleep(0.1)
    for _ in range(100):  # the other workers' last lines may trail the last stage's by a moment
        if all(len(follower.steps(k)) >= cfg.steps for k in keys):
            break
        time.sleep(0.1)
        follower.poll()
    losses = [e["loss"] for e in follower.steps(last_key)]
    if cfg.sync == "diloco":  # each pipeline reports its own shard's loss: the run's is their mean
        per_replica = [[e["loss"] for e in follower.steps(f"{cfg.stages - 1}/{r}")] for r in range(cfg.replicas)]
        losses = [sum(values) / cfg.replicas for values in zip(*per_replica, strict=True)]
    step_times = [max(follower.steps(k)[i]["step_time_s"] for k in keys if len(follower.steps(k)) > i)
                  for i in range(cfg.steps)]
    if launch.check_replicas:
        for stage in range(cfg.stages):
            for step in range(cfg.steps):
                if cfg.sync == "diloco" and not cfg.diloco.round_ends(step, cfg.steps):
                    continue  # DiLoCo replicas agree at the end of each round, not within it
                digests = {follower.steps(f"{stage}/{r}")[step].get("digest") for r in range(cfg.replicas)}
                if len(digests) != 1:
                    raise ReplicaMismatch(f"replicas of stage {stage} differ after step {step}: {sorted(digests)}")
    peers = {key: next((e["peer"] for e in follower.events[key] if e.get("event") == "ready"), "") for key in keys}
    return DistributedResult(losses=losses, step_time_s=step_times, replicas_identical=launch.check_replicas, workdir="", peers=peers)
