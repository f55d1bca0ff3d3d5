"""Helpers for the agent tests: the swarm as a real command, its status file, process trees; a measured world of
records for the plan checks."""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


def swarm_command(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", "swarm", "--workdir", str(workdir), *args]


def run_swarm(workdir: Path, *args: str, timeout_s: float = 240) -> tuple[int, dict | None, str]:
    """Run ``p2ptrain swarm --json`` to the end: (exit code, the JSON summary or None, stderr). The command is
    forked from the session's shared fork server where there is one (``conftest.shared_fork_server``: it
    imports nothing), started as a new interpreter otherwise; either way it is the real command."""
    from p2ptrain.runtime.forkserver import ForkServer

    argv = swarm_command(workdir, "--json", *args)
    server = ForkServer.shared(("p2ptrain.cli", "p2ptrain.cli.swarm"))
    if server is None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc, proc.communicate)
            raise
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        out, err = workdir / "swarm.out", workdir / "swarm.err"
        err.unlink(missing_ok=True)
        try:
            proc = server.spawn(argv, stdout_path=out, stderr_path=err)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop(proc, proc.wait)
                raise
        finally:
            server.close()
        stdout, stderr = out.read_text(), err.read_text()
    summary = json.loads(stdout) if stdout.strip() else None
    if proc.returncode != 0:
        print(log_tails(workdir))  # pytest shows it beside the failure: CI keeps no workdir to read afterwards
    assert_no_logging_errors(workdir)
    return proc.returncode, summary, stderr


def _stop(proc, wait) -> None:
    """SIGTERM (the swarm stops every process it started; SIGKILL would orphan them), then SIGKILL after 60 s."""
    proc.terminate()
    try:
        wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        wait(timeout=60)


def log_tails(workdir: Path, lines: int = 12, width: int = 240) -> str:
    """The last ``lines`` lines of each log under ``workdir`` (each cut to ``width`` characters): what a failed
    swarm's agents were doing, for a failure seen only in a CI run's output."""
    out = []
    for path in sorted(workdir.rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out += [f"--- {path.relative_to(workdir)} (last {len(tail)} lines)", *(line[:width] for line in tail)]
    return "\n".join(out)


def assert_no_logging_errors(workdir: Path) -> None:
    """No log line under ``workdir`` failed to format (logging prints a traceback instead of the line: a
    published plan went unlogged that way for every fixed-order plan)."""
    marker = "--- Logging error ---"
    for path in workdir.rglob("*.log"):
        text = path.read_text(errors="replace")
        assert marker not in text, f"a log call failed to format in {path}: {text.split(marker, 1)[1][:3000]}"


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def read_status(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / "swarm.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def events(path: str | Path) -> list[dict]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def rolled_back(plans: list[dict], reached: list[dict]) -> list[int]:
    """Per re-plan (every ``plan`` event after the first, in epoch order; repeats of an epoch count once), the
    steps it redoes past its start: the furthest step reached (``reached``: events with an epoch and a step in
    steps done, e.g. honest members' ``step`` events: the steps they applied) in the epochs since the plan
    before it, minus the step it restarts from (``start_step``: steps done), never below 0."""
    plans = sorted({p["epoch"]: p for p in plans}.values(), key=lambda p: p["epoch"])
    out = []
    for before, plan in itertools.pairwise(plans):
        steps = [e["step"] for e in reached if before["epoch"] <= e["epoch"] < plan["epoch"]]
        out.append(max(0, max(steps, default=plan["start_step"]) - plan["start_step"]))
    return out


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process it started (its DHT process, p2pd, ...)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def bootstrap_maddrs(workdir: Path, timeout_s: float = 90) -> list[str]:
    """The swarm's bootstrap address line (``<workdir>/bootstrap.maddrs``), once written."""

    def read() -> str | None:
        try:
            return (workdir / "bootstrap.maddrs").read_text().strip() or None
        except FileNotFoundError:
            return None

    return wait_for(read, timeout_s, "the bootstrap's address line").split()


def sorted_identities(workdir: Path, count: int) -> None:
    """Identity files agent-0..agent-(count-1) in the swarm's work dir, in peer-ID (election) order."""
    from p2ptrain.net.identity import generate_identity

    for k, identity in enumerate(sorted((generate_identity() for _ in range(count)), key=lambda i: i.peer_id)):
        (workdir / f"agent-{k}.id").write_bytes(identity.to_protobuf())
        (workdir / f"agent-{k}.id").chmod(0o600)


def run_agents(workdir: Path, config, commands: dict, overrides: dict, timeout_s: float, on_start=None,
               agent_overrides: dict | None = None, awaited: tuple[int, ...] = ()):
    """A swarm started by hand: a bootstrap and ``config.agents`` agents with the settings ``p2ptrain swarm``
    writes (each table updated from ``overrides``, then agent k's from ``agent_overrides[k]``), agent k running ``commands[k] + [its config file]``
    where given (a misbehaving peer), ``p2ptrain agent --config`` otherwise. Waits until every agent without
    a command exited, and those of ``awaited`` (an honest agent run by its own command; ``on_start(group, agents)``
    runs once they are started), then stops the rest. Returns (agents, exit codes of those waited for, train
    config)."""
    import tomllib

    from p2ptrain.runtime.procgroup import ProcessGroup, tail
    from p2ptrain.swarm.agent_launcher import AGENT_MODULES, _agent_toml, _prepare_agents, plan_swarm, to_toml

    train, network, time_scale, size_factor = plan_swarm(config)
    cluster_path = None
    if network is not None:
        cluster_path = workdir / "cluster.json"
        cluster_path.write_text(json.dumps(network.to_dict()))
    agents = _prepare_agents(workdir, range(config.agents))
    with ProcessGroup(grace_s=15.0) as group:
        group.use_fork_server(AGENT_MODULES, log_path=workdir / "forkserver.log")  # as ``p2ptrain swarm`` does
        announce = workdir / "bootstrap.maddrs"
        group.start("bootstrap", [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs",
                                  "/ip4/127.0.0.1/tcp/0", "--announce-file", str(announce), "--run-id", config.run],
                    log_path=workdir / "bootstrap.log", fork=True)
        wait_for(announce.exists, 90, "the bootstrap's address line")
        maddrs = announce.read_text().split()
        for agent in agents:
            tables = tomllib.loads(_agent_toml(config, train, config.run, maddrs, agent, workdir, cluster_path,
                                               time_scale, size_factor))
            for changes in (overrides, (agent_overrides or {}).get(agent.index, {})):
                for table, values in changes.items():
                    tables.setdefault(table, {}).update(values)
            agent.config_path.write_text(to_toml(tables))
            argv = [*commands.get(agent.index, [sys.executable, "-m", "p2ptrain", "agent", "--config"]),
                    str(agent.config_path)]
            group.start(agent.name, argv, log_path=agent.log_path, fork=True)
        if on_start is not None:
            on_start(group, agents)
        deadline = time.monotonic() + timeout_s
        honest = [a for a in agents if a.index not in commands or a.index in awaited]
        for agent in honest:
            child = group.children[agent.name]
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        codes = {a.name: group.children[a.name].poll() for a in honest}
        if any(code != 0 for code in codes.values()):
            print("\n".join(f"--- {a.name}\n{tail(a.log_path, 40)}" for a in agents))
    assert_no_logging_errors(workdir)
    return agents, codes, train


def join_once_planned(*joiners: int):
    """An ``on_start`` for ``run_agents``: agents ``joiners`` (running ``gated_agent.py``) publish their peer
    records, and so join, once agent-0 (the leader: identities sorted) has published the first plan."""

    def on_start(group, agents) -> None:
        def open_gates() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(e["event"] == "plan" for e in events(agents[0].events.path)):
                time.sleep(0.2)
            for k in joiners:
                Path(f"{agents[k].config_path}.go").touch()

        threading.Thread(target=open_gates, daemon=True).start()

    return on_start


@contextlib.contextmanager
def background_swarm(workdir: Path, *args: str):
    """``p2ptrain swarm --json`` started in the background (stderr in ``<workdir>/swarm.stderr``), for a
    test that does something beside it; whatever happens inside, the swarm is stopped (SIGTERM: it stops
    every process it started) and waited for on the way out."""
    with open(workdir / "swarm.stderr", "w") as stderr:
        swarm = subprocess.Popen(swarm_command(workdir, "--json", *args), stdout=subprocess.PIPE, stderr=stderr,
                                 text=True)
        try:
            yield swarm
        finally:
            if swarm.poll() is None:
                swarm.terminate()
                swarm.wait(60)


REFERENCES_ENV = "P2PTRAIN_TEST_REFERENCES"  # a folder the session's workers share (conftest.shared_references)


def reference_losses(train, stop_after: int | None = None) -> list[float]:
    """``train_reference(train, stop_after=...).losses``, computed once per test session: the run is
    deterministic, so every test that checks a swarm against the same settings (the whole configuration is
    the key, with torch's version) reads the losses the first one computed. Without the session's folder, as
    computed now."""
    import dataclasses
    import hashlib
    import os

    import torch

    from p2ptrain.runtime.reference import train_reference

    folder = os.environ.get(REFERENCES_ENV)
    text = json.dumps([dataclasses.asdict(train), stop_after, torch.__version__], sort_keys=True, default=repr)
    path = Path(folder) / f"{hashlib.sha256(text.encode()).hexdigest()}.json" if folder else None
    if path is not None and path.exists():
        return json.loads(path.read_text())
    losses = list(train_reference(train, stop_after=stop_after).losses)
    if path is not None:
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps(losses))
        os.replace(partial, path)  # whole or not there: another worker reads it only complete
    return losses


def measured_world(devices: int = 5):
    """``devices`` peers (IDs sorted) playing the first world-wide devices: their records and links rows."""
    from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord
    from p2ptrain.net.identity import generate_identity
    from p2ptrain.planning.scenarios import scenario

    peers = sorted(generate_identity().peer_id for _ in range(devices))
    net = scenario("worldwide", devices)
    records = {p: PeerRecord(device_name=f"dev{k}", memory_gb=16.0, tflops=10.0) for k, p in enumerate(peers)}
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(float(net.latency_ms[i, j]), float(net.bandwidth_gbps[i, j]))
                                       for j, b in enumerate(peers) if j != i})
            for i, a in enumerate(peers)}
    return peers, records, rows
