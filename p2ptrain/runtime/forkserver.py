"""A fork server: one process that imports torch, hivemind and p2ptrain once, then forks the Python processes
a launcher starts (agents, a monitor), instead of each new interpreter importing them again: about 3 s of
CPU per process, which on a small machine was a third of a local swarm's start-up.

    server = ForkServer(preload=("p2ptrain.agent.agent", "p2ptrain.cli.agent")).start()   # imports meanwhile
    child = server.spawn([sys.executable, "-m", "p2ptrain", "agent", "--config", "a.toml"], stderr_path=log)
    child.wait(timeout=60)                                                                 # Popen's methods
    server.close()

A spawned process is what ``subprocess.Popen`` would have started, as far as it and its launcher can tell:
a session of its own (``setsid``, so that a signal to its process group reaches what it starts), stdin from
/dev/null, stdout and stderr to the given files, the launcher's environment and working directory at the
time of the call, ``sys.argv`` as the command line says, fresh random states, the module (``-m``) or script
run as ``__main__``, and the interpreter's normal exit (atexit handlers, coverage's included). What differs:
``/proc/PID/cmdline`` shows the server's command line (each process's log and events say what it is), and
environment variables that torch or hivemind read when imported were read once, by the server. The locks
hivemind makes when imported are made anew in each child (``_own_process_locks``): a child killed while holding
one must not hang its siblings.

The server never starts a thread or CUDA (a fork would copy a held lock, and a forked child cannot use a
CUDA its parent initialised): it refuses to serve if its imports did either.

Protocol, one JSON document per line: the launcher writes ``{"argv", "cwd", "env", "stdout", "stderr"}``
to the server's stdin and reads ``{"pid": N}`` (or ``{"error": "..."}``) from its stdout, and later
``{"exited": N, "code": C}`` when that child ends (``C`` as Popen's ``returncode``: negative for a signal).
The server ends once told to (``{"exit": true}``) or once its stdin ends, when every child it started has
exited.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


# ---- the launcher's side ----------------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen``'s interface launchers use."""

    stdin = None

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]):
        self._server, self.pid, self.args = server, pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server._wait_exit(self.pid, left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts ``python -m p2ptrain.runtime.forkserver PRELOAD...`` and spawns processes through it."""

    def __init__(self, preload: Sequence[str], log_path: Path | None = None, ready_timeout_s: float = 180.0):
        self.preload, self.log_path, self.ready_timeout_s = tuple(preload), log_path, ready_timeout_s
        self._popen: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._codes: dict[int, int] = {}
        self._reader: threading.Thread | None = None

    @staticmethod
    def can_run(argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a Python command the server runs: ``python -m MODULE ...`` or ``python SCRIPT ...``."""
        if len(argv) < 2 or Path(argv[0]).name not in {Path(sys.executable).name, "python", "python3"}:
            return False
        return (argv[1] == "-m" and len(argv) > 2) or (not argv[1].startswith("-") and argv[1].endswith(".py"))

    def start(self) -> ForkServer:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", __name__, *self.preload], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._reader = threading.Thread(target=self._read, name="p2ptrain-forkserver-reader", daemon=True)
        self._reader.start()
        return self

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def spawn(self, argv: Sequence[str], *, stdout_path: Path | None = None, stderr_path: Path | None = None,
              env: Mapping[str, str] | None = None, cwd: Path | None = None) -> ForkedProcess:
        """Fork a process running ``argv`` (``can_run``); stdout goes to ``stdout_path`` (truncated), stderr to
        ``stderr_path`` (appended; stdout too unless given). Waits for the server's imports the first time."""
        if not self.can_run(argv):
            raise ValueError(f"the fork server runs 'python -m MODULE' or 'python SCRIPT.py', not {list(argv)}")
        request = {"argv": list(argv), "cwd": str(cwd or os.getcwd()),
                   "env": dict(env if env is not None else os.environ),
                   "stdout": str(stdout_path) if stdout_path else None,
                   "stderr": str(stderr_path) if stderr_path else None}
        with self._lock:
            assert self._popen is not None and self._popen.stdin is not None, "start() the fork server first"
            try:
                self._popen.stdin.write(json.dumps(request).encode() + b"\n")
                self._popen.stdin.flush()
            except OSError as e:
                raise RuntimeError(f"the fork server is gone ({e}){self._log_hint()}") from None
            reply = self._next_reply(self.ready_timeout_s)
        if "error" in reply:
            raise RuntimeError(f"the fork server could not start {list(argv)}: {reply['error']}")
        return ForkedProcess(self, int(reply["pid"]), argv)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server: it is told to, waits for its children (stop them first), then exits. (Told, not
        just left with a closed stdin: a process this one forked since, such as a DHT, holds the pipe open.)"""
        if self._popen is None:
            return
        try:
            if self._popen.stdin is not None and not self._popen.stdin.closed:
                with self._lock:
                    self._popen.stdin.write(b'{"exit": true}\n')
                    self._popen.stdin.close()
        except OSError:
            pass
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the fork server (pid %d) did not end within %.0f s; killing it", self._popen.pid, timeout_s)
            self._popen.kill()
            self._popen.wait(timeout=timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)

    # the reader thread: replies in order, exit codes by pid

    def _read(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for line in self._popen.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                logger.warning("the fork server wrote a line that is not JSON: %r", line[:200])
                continue
            with self._changed:
                if "exited" in message:
                    self._codes[int(message["exited"])] = int(message["code"])
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:  # the server ended: nothing more will come
            self._changed.notify_all()

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._replies:
                if not self._alive():
                    raise RuntimeError(f"the fork server exited with code {self._popen.poll()}{self._log_hint()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fork server did not answer within {timeout_s:.0f} s{self._log_hint()}")
                self._changed.wait(0.5)
            return self._replies.pop(0)

    def _exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._codes:
                return self._codes[pid]
        if self._alive() or _exists(pid):
            return None
        # The server died before reporting: the child was reparented and reaped elsewhere; its code is lost.
        logger.warning("the exit code of pid %d is lost with its fork server; counting it as failed", pid)
        return 1

    def _wait_exit(self, pid: int, timeout_s: float | None) -> None:
        with self._changed:
            if pid not in self._codes:
                self._changed.wait(min(0.5, timeout_s) if timeout_s is not None else 0.5)

    def _alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def _log_hint(self) -> str:
        return f"; see {self.log_path}" if self.log_path else ""


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the server's side ------------------------------------------------------------------------------------


def serve(preload: Sequence[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if threading.active_count() != 1 or (torch is not None and torch.cuda.is_initialized()):
        raise SystemExit("fork server: the preloaded modules started a thread or CUDA; forking would not be safe")
    children: set[int] = set()
    pending, open_input = b"", True
    while open_input or children:
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.1)
        if ready:
            chunk = os.read(0, 1 << 16)
            open_input = bool(chunk)
            pending += chunk
            while b"\n" in pending and open_input:
                line, pending = pending.split(b"\n", 1)
                open_input = _handle(line, children)
        _reap(children)


def _handle(line: bytes, children: set[int]) -> bool:
    """Serve one request; False once told to end."""
    try:
        request = json.loads(line)
        if request.get("exit"):
            return False
        argv = request["argv"]
        if not ForkServer.can_run(argv):
            raise ValueError(f"not a Python command the server runs: {argv}")
        out = open(request["stdout"], "wb") if request["stdout"] else None  # noqa: SIM115 - the child's
        err = open(request["stderr"], "ab") if request["stderr"] else None  # noqa: SIM115
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        _send({"error": f"{type(e).__name__}: {e}"})
        return True
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the server's loop
        os.close(started_r)
        _become(request, out, err)
        os.close(started_w)  # its session exists: a signal to its group from now on reaches it
        _run(argv)
        raise SystemExit(0)
    os.close(started_w)
    os.read(started_r, 1)  # returns once the child closed its end (or died)
    os.close(started_r)
    for f in (out, err):
        if f is not None:
            f.close()
    children.add(pid)
    _send({"pid": pid})
    return True


def _become(request: dict[str, Any], out, err) -> None:
    """Turn the forked server into the process ``request`` asks for (module docstring)."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the server's requests and replies are not the child's
    os.close(devnull)
    if err is not None or out is not None:
        os.dup2((out or err).fileno(), 1)
        os.dup2((err or out).fileno(), 2)
    else:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
    for f in (out, err):
        if f is not None:
            f.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()
    if (torch := sys.modules.get("torch")) is not None:
        torch.seed()
    _own_process_locks()


def _own_process_locks() -> None:
    """Fresh copies of the multiprocessing locks the server's imports made: a lock created at import time is a
    semaphore every process forked since shares. hivemind takes one (``MPFuture._update_lock``) to send each
    result of its DHT process, and one (``SharedBytes._lock``) for each future it makes: an agent SIGKILLed
    while it held one hung the DHT of every other agent of the swarm for good (each forked from this server),
    where processes started apart share nothing. A child starts with no future of hivemind's yet."""
    import multiprocessing

    if (mpfuture := sys.modules.get("hivemind.utils.mpfuture")) is not None:
        mpfuture.MPFuture.reset_backend()  # new _initialization_lock, _update_lock and SharedBytes._lock
    if (aio := sys.modules.get("hivemind.utils.asyncio")) is not None:
        aio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()  # noqa: SLF001 - same, for its executor


def _run(argv: Sequence[str]) -> None:
    import runpy

    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[1])
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send({"exited": pid, "code": code})


def _send(message: dict[str, Any]) -> None:
    try:
        os.write(1, json.dumps(message).encode() + b"\n")
    except OSError:  # the launcher is gone: its children are stopped by their process groups, not by us
        pass


if __name__ == "__main__":
    serve(sys.argv[1:])
