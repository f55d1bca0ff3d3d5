"""Child processes that never outlive their parent: start, watch, stop, reap.

The local launcher of ``p2ptrain train`` and the swarm both start real processes (workers, agents, a
bootstrap). Each child runs in its own session (``start_new_session``), so a signal to the child's process
group reaches everything it started (its DHT process, its libp2p daemon) even when the child itself died
without cleaning up. Stopping is always: SIGTERM to the group, wait up to a grace period, then SIGKILL to
the group; every child is waited for, so none is left a zombie.

Usage::

    with ProcessGroup() as group:
        group.start("worker-0", [sys.executable, "-m", "p2ptrain.runtime.worker", ...], log_path=...)
        group.wait_all(deadline_s=600, on_tick=print_progress)   # raises ChildFailed on the first failure

A group that starts many Python processes of one kind can fork them from a server that imported their
modules once (``use_fork_server``, then ``start(..., fork=True)``; ``runtime.forkserver``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.runtime.forkserver import ForkedProcess, ForkServer

logger = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child exited with a non-zero code (or did not finish before its deadline)."""

    def __init__(self, name: str, returncode: int | None, log_path: Path | None, reason: str = ""):
        tail = f"; log: {log_path}" if log_path else ""
        what = reason or (f"exited with code {returncode}" if returncode is not None else "did not finish")
        super().__init__(f"{name} {what}{tail}")
        self.name = name
        self.returncode = returncode
        self.log_path = log_path


@dataclass
class Child:
    name: str
    popen: subprocess.Popen | ForkedProcess
    log_path: Path | None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()


class ProcessGroup:
    """A set of named child processes, each in its own session, all stopped and reaped on exit."""

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.children: dict[str, Child] = {}
        self.fork_server: ForkServer | None = None

    def use_fork_server(self, preload: Sequence[str], log_path: Path | None = None) -> None:
        """Start a fork server importing ``preload`` now (it imports while this process goes on); children
        started with ``fork=True`` are forked from it. It ends with the group, after its children."""
        if self.fork_server is None:
            self.fork_server = ForkServer(preload, log_path).start()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        stdout_path: Path | None = None,
        fork: bool = False,
    ) -> Child:
        """Start ``argv`` as child ``name``; stderr goes to ``log_path`` (stdout too unless ``stdout_path``).
        With ``fork`` and a fork server (``use_fork_server``), a Python command is forked from it."""
        if name in self.children:
            raise ValueError(f"a child called {name!r} is already running")
        if fork and self.fork_server is not None and self.fork_server.can_run(argv):
            forked = self.fork_server.spawn(argv, stdout_path=stdout_path, stderr_path=log_path, env=env, cwd=cwd)
            self.children[name] = child = Child(name, forked, log_path)
            logger.debug("forked %s (pid %d): %s", name, forked.pid, " ".join(argv))
            return child
        log_file = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        out_file = open(stdout_path, "wb") if stdout_path else log_file  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out_file,
                stderr=log_file,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            for f in {id(log_file): log_file, id(out_file): out_file}.values():
                if f is not subprocess.DEVNULL:
                    f.close()
        child = Child(name, popen, log_path)
        self.children[name] = child
        logger.debug("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return child

    def pids(self) -> dict[str, int]:
        return {name: child.pid for name, child in self.children.items()}

    def running(self) -> list[str]:
        return [name for name, child in self.children.items() if child.poll() is None]

    def failed(self) -> list[Child]:
        return [c for c in self.children.values() if c.poll() not in (None, 0)]

    def wait_all(
        self,
        deadline_s: float,
        *,
        names: Sequence[str] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.5,
        fail_fast: bool = True,
    ) -> None:
        """Wait until the named children (default: all) exit with code 0.

        Raises ChildFailed for the first child that exits non-zero (when ``fail_fast``) or for the first one
        still running when ``deadline_s`` seconds have passed.
        """
        watched = list(names) if names is not None else list(self.children)
        deadline = time.monotonic() + deadline_s
        while True:
            pending = []
            for name in watched:
                child = self.children[name]
                code = child.poll()
                if code is None:
                    pending.append(name)
                elif code != 0 and fail_fast:
                    raise ChildFailed(name, code, child.log_path)
            if not pending:
                bad = [self.children[n] for n in watched if self.children[n].poll() != 0]
                if bad:
                    raise ChildFailed(bad[0].name, bad[0].poll(), bad[0].log_path)
                return
            if time.monotonic() > deadline:
                child = self.children[pending[0]]
                raise ChildFailed(child.name, None, child.log_path, reason=f"still running after {deadline_s:.0f} s")
            if on_tick is not None:
                on_tick()
            time.sleep(tick_s)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to child ``name``'s whole process group (the child and everything it started)."""
        child = self.children[name]
        _signal_group(child.pid, sig)

    def stop(self, name: str, grace_s: float | None = None) -> int | None:
        """SIGTERM the child's group, wait up to the grace period, then SIGKILL; returns the exit code."""
        child = self.children[name]
        grace = self.grace_s if grace_s is None else grace_s
        if child.poll() is None:
            _signal_group(child.pid, signal.SIGTERM)
            try:
                child.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", name, child.pid, grace)
        # The child may have exited while something it started (a DHT process, p2pd) lingers in its group.
        _signal_group(child.pid, signal.SIGKILL)
        try:
            child.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            logger.error("%s (pid %d) survived SIGKILL", name, child.pid)
        return child.poll()

    def stop_all(self) -> None:
        # SIGTERM everyone first so shutdowns overlap, then stop one by one; the fork server last.
        for child in self.children.values():
            if child.poll() is None:
                _signal_group(child.pid, signal.SIGTERM)
        for name in list(self.children):
            self.stop(name)
        if self.fork_server is not None:
            self.fork_server.close(self.grace_s)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
        if sig == signal.SIGTERM:  # a stopped process (SIGSTOP, a frozen machine) handles it once continued
            os.killpg(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path | None, num_lines: int = 20) -> str:
    """The last lines of a log file, for error messages."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])
