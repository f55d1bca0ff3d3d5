"""Shared fixtures: a deadline on every test (pytest-timeout, pyproject), no process left behind, and one fork
server per test worker that every launcher of the session uses (``runtime.forkserver.start_shared``)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

_WATCHED_NAMES = ("p2pd",)
# torch starts one shared-memory manager per process that makes a hivemind future under hivemind's own sharing
# strategy (a test's process; ours share by file descriptor, ``net.p2p_fixes``); it lives as long as that process,
# so it is not something a test leaked.
_PROCESS_LIFETIME_HELPERS = ("torch_shm_manager",)


def pytest_collection_modifyitems(config, items):
    """With two workers (pyproject: ``-n 2``): the tests that build namespaces, veth pairs and NAT rules run
    one after another on one worker."""
    for item in items:
        if "realnet" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("realnet"))


def _descendants() -> list[psutil.Process]:
    """Our children, plus every libp2p daemon on the machine (an orphaned one is no longer our child)."""
    try:
        procs = {p.pid: p for p in psutil.Process(os.getpid()).children(recursive=True)}
    except psutil.Error:
        procs = {}
    for p in psutil.process_iter(["name", "ppid"]):
        # Only orphans (re-parented to pid 1): a daemon with a live parent belongs to that parent's tree,
        # possibly another test session on this shared machine, and must be neither blamed nor killed here.
        if p.info["name"] in _WATCHED_NAMES and p.info["ppid"] == 1:
            procs.setdefault(p.pid, p)
    return [p for p in procs.values() if _name(p) not in _PROCESS_LIFETIME_HELPERS]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


# What the session's launchers preload (the swarm's agents, ``train``'s workers, the swarm command itself): a
# launcher whose own list the shared server's covers forks from it and imports nothing.
SHARED_PRELOAD = ("p2ptrain.cli", "p2ptrain.cli.agent", "p2ptrain.cli.bootstrap", "p2ptrain.cli.swarm",
                  "p2ptrain.agent.agent", "p2ptrain.runtime.worker", "torch._dynamo", "torch._inductor.config")


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server(tmp_path_factory):
    """One fork server for the worker's session: each swarm, ``train`` and swarm command a test starts forks
    its processes from it instead of starting a server that imports torch and hivemind again (about 6 s of CPU
    each). Tests of a launcher's own server or of a process tree say so (``ForkServer(share=False)``, the
    variable removed from the environment)."""
    from p2ptrain.runtime.forkserver import SHARED_ENV, start_shared, stop_shared
    from p2ptrain.runtime.worker_launcher import WORKER_MODULES
    from p2ptrain.swarm.agent_launcher import AGENT_MODULES

    assert set(AGENT_MODULES) | set(WORKER_MODULES) <= set(SHARED_PRELOAD), "the shared preload is out of date"
    root = tmp_path_factory.getbasetemp()
    path = root / "forks.sock"
    server = start_shared(SHARED_PRELOAD, path, log_path=root / "forks.log")
    previous = os.environ.get(SHARED_ENV)
    os.environ[SHARED_ENV] = str(path)
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(SHARED_ENV, None)
        else:
            os.environ[SHARED_ENV] = previous
        stop_shared(server)


@pytest.fixture(scope="session", autouse=True)
def shared_references(tmp_path_factory):
    """A folder the session's workers share for single-process reference losses (``agent_helpers.reference_losses``:
    each configuration's computed once)."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' basetemps' parent
    folder = shared / "references"
    folder.mkdir(exist_ok=True)
    os.environ["P2PTRAIN_TEST_REFERENCES"] = str(folder)
    yield folder
    os.environ.pop("P2PTRAIN_TEST_REFERENCES", None)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every child process a test starts (workers, DHT processes, p2pd daemons) is gone when it ends.

    Processes still alive a few seconds after the test are killed, and the test fails naming them, so a
    leak is reported rather than hidden.
    """
    before = {p.pid for p in _descendants()}
    yield
    deadline = time.monotonic() + 10.0
    leaked: list[psutil.Process] = []
    while time.monotonic() < deadline:
        leaked = [p for p in _descendants() if p.pid not in before and _alive(p)]
        if not leaked:
            return
        time.sleep(0.2)
    names = []
    for p in leaked:
        try:
            names.append(f"{p.pid}:{' '.join(p.cmdline()[:3])}")
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    pytest.fail(f"processes left running after the test: {names}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
