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
run as ``__main__``, and what the interpreter's exit does that others see (non-daemon threads joined, atexit
handlers run, coverage's included, streams flushed: ``quick_exit``, without the 1.3 s teardown). What differs:
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

A process that starts many launchers (a test session, a benchmark campaign) can share one server
(``start_shared``): it also listens on a Unix socket only its user can open, named to the launchers by
``P2PTRAIN_FORK_SERVER``. A launcher that connects first reads a hello (the server's pid, interpreter, network
namespace, ``PYTHONPATH`` and preloaded modules) and uses the server only if it fits (``unfit``: a child forked
in another network namespace would not be on the launcher's network); otherwise it starts its own. On a
connection the protocol is the same, each child's exit goes to the connection that asked for it, and
``{"exit": true}`` ends the connection, not the server.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2ptrain.runtime import quick_exit

logger = logging.getLogger(__name__)

SHARED_ENV = "P2PTRAIN_FORK_SERVER"  # the Unix socket of a shared server (``start_shared``), for launchers to use


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
    """Starts ``python -m p2ptrain.runtime.forkserver PRELOAD...`` and spawns processes through it; or, with
    ``share`` and a shared server named by ``P2PTRAIN_FORK_SERVER`` (``start_shared``) that fits, spawns
    through that one instead (``attached``)."""

    def __init__(self, preload: Sequence[str], log_path: Path | None = None, ready_timeout_s: float = 180.0,
                 share: bool = True):
        self.preload, self.log_path, self.ready_timeout_s, self.share = tuple(preload), log_path, ready_timeout_s, share
        self._popen: subprocess.Popen | None = None
        self._connection: socket.socket | None = None  # to a shared server
        self._requests: Any = None  # where requests go: the server's stdin, or the connection
        self._server_pid: int | None = None
        self._ended = False  # the server's replies ended
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._codes: dict[int, int] = {}
        self._reader: threading.Thread | None = None

    @property
    def attached(self) -> bool:
        """Whether this spawns through a shared server (which it neither started nor ends)."""
        return self._connection is not None

    @staticmethod
    def can_run(argv: Sequence[str]) -> bool:
        """Whether ``argv`` is a Python command the server runs: ``python -m MODULE ...`` or ``python SCRIPT ...``."""
        if len(argv) < 2 or Path(argv[0]).name not in {Path(sys.executable).name, "python", "python3"}:
            return False
        return (argv[1] == "-m" and len(argv) > 2) or (not argv[1].startswith("-") and argv[1].endswith(".py"))

    def start(self) -> ForkServer:
        path = os.environ.get(SHARED_ENV) if self.share else None
        if path and self._attach(path):
            return self
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", __name__, *self.preload], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._requests, self._server_pid = self._popen.stdin, self._popen.pid
        self._start_reader(self._popen.stdout)
        return self

    @classmethod
    def shared(cls, preload: Sequence[str], log_path: Path | None = None) -> ForkServer | None:
        """The shared server named by ``P2PTRAIN_FORK_SERVER``, attached, if there is one that fits; else None."""
        server, path = cls(preload, log_path), os.environ.get(SHARED_ENV)
        return server if path and server._attach(path) else None

    def _attach(self, path: str) -> bool:
        """Use the shared server at ``path`` if it answers and fits (``unfit``); False (logged) otherwise."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(self.ready_timeout_s)  # its hello comes once its imports are done
            connection.connect(path)
            replies = connection.makefile("rb")
            hello = json.loads(replies.readline() or b"{}").get("hello")
            why = unfit(hello, self.preload)
        except (OSError, ValueError, AttributeError) as e:
            why = f"it does not answer ({type(e).__name__}: {e})"
        if why:
            logger.info("not using the shared fork server at %s: %s; starting one of our own", path, why)
            connection.close()
            return False
        connection.settimeout(None)
        self._connection, self._requests, self._server_pid = connection, connection.makefile("wb"), hello["pid"]
        self._start_reader(replies)
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(f"forked by the shared fork server (pid {hello['pid']}, {path})\n")
        return True

    def _start_reader(self, replies) -> None:
        self._reader = threading.Thread(target=self._read, args=(replies,), name="p2ptrain-forkserver-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._server_pid

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
            assert self._requests is not None, "start() the fork server first"
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
            except OSError as e:
                raise RuntimeError(f"the fork server is gone ({e}){self._log_hint()}") from None
            reply = self._next_reply(self.ready_timeout_s)
        if "error" in reply:
            raise RuntimeError(f"the fork server could not start {list(argv)}: {reply['error']}")
        return ForkedProcess(self, int(reply["pid"]), argv)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server: it is told to, waits for its children (stop them first), then exits. (Told, not
        just left with a closed stdin: a process this one forked since, such as a DHT, holds the pipe open.)
        A shared server is only told that this launcher is done; it goes on for the others."""
        if self._requests is None:
            return
        try:
            if not self._requests.closed:
                with self._lock:
                    self._requests.write(b'{"exit": true}\n')
                    self._requests.close()
        except OSError:
            pass
        if self._connection is not None:
            self._connection.close()
        elif self._popen is not None:
            try:
                self._popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the fork server (pid %d) did not end within %.0f s; killing it", self._popen.pid,
                               timeout_s)
                self._popen.kill()
                self._popen.wait(timeout=timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)

    # the reader thread: replies in order, exit codes by pid

    def _read(self, replies) -> None:
        for line in replies:
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
        with self._changed:  # the server ended (or our connection): nothing more will come
            self._ended = True
            self._changed.notify_all()

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._replies:
                if not self._alive():
                    code = self._popen.poll() if self._popen is not None else "unknown"
                    raise RuntimeError(f"the fork server exited with code {code}{self._log_hint()}")
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
        if self._connection is not None:
            return not self._ended
        return self._popen is not None and self._popen.poll() is None

    def _log_hint(self) -> str:
        return f"; see {self.log_path}" if self.log_path else ""


def unfit(hello: dict[str, Any] | None, preload: Sequence[str]) -> str | None:
    """Why a shared server that said ``hello`` cannot fork what a launcher preloading ``preload`` starts (None:
    it can): another interpreter, another network namespace (its children would not be on our network),
    another ``PYTHONPATH``, or a module we would preload that it did not."""
    if not isinstance(hello, dict):
        return "it did not say hello"
    missing = sorted(set(preload) - set(hello.get("preload", ())))
    theirs = {"executable": hello.get("executable"), "network namespace": hello.get("netns"),
              "PYTHONPATH": hello.get("pythonpath")}
    ours = {"executable": sys.executable, "network namespace": _namespace("net"),
            "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    differ = [what for what in ours if theirs[what] != ours[what]]
    if differ:
        return f"its {differ[0]} is {theirs[differ[0]]!r}, ours {ours[differ[0]]!r}"
    if not isinstance(hello.get("pid"), int):
        return "it did not say its pid"
    return f"it did not preload {', '.join(missing)}" if missing else None


def start_shared(preload: Sequence[str], path: Path, log_path: Path | None = None,
                 bind_timeout_s: float = 60.0) -> subprocess.Popen:
    """Start a fork server that also serves every launcher that connects to the Unix socket ``path`` (only its
    owner's user can): for a process that starts many launchers (a test session, a benchmark campaign), which
    then import nothing twice. Set ``P2PTRAIN_FORK_SERVER`` to ``path`` in their environment; the server
    binds the socket at once and answers once its imports are done. It ends with ``stop_shared`` (or when
    this process exits), once every child it forked has exited."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        server = subprocess.Popen([sys.executable, "-m", __name__, "--listen", str(path), *preload],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
    deadline = time.monotonic() + bind_timeout_s
    while not Path(path).exists():  # bound before its imports: a moment after the interpreter starts
        if server.poll() is not None or time.monotonic() > deadline:
            stop_shared(server)
            raise RuntimeError(f"the shared fork server did not bind {path} within {bind_timeout_s:.0f} s"
                               + (f"; see {log_path}" if log_path else ""))
        time.sleep(0.02)
    return server


def stop_shared(server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """End a server of ``start_shared``: its stdin closes, it stops serving and exits once its children did."""
    if server.stdin is not None:
        with contextlib.suppress(OSError):
            server.stdin.close()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("the shared fork server (pid %d) did not end within %.0f s; killing it", server.pid, timeout_s)
        server.kill()
        server.wait(timeout=timeout_s)


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the server's side ------------------------------------------------------------------------------------

MAX_REQUEST_BYTES = 4 << 20  # a request line (command, environment, paths), at most
_SERVER_SOCKETS: dict[int, socket.socket] = {}  # the listener and the connections, by descriptor: not a child's


def serve(preload: Sequence[str], listen: str | None = None) -> None:
    """Import ``preload``, then fork what the owner (stdin/stdout) asks for; with ``listen``, also what any
    launcher connected to the Unix socket at that path asks for (``shared``), until the owner's stdin ends."""
    listener = _listen(listen) if listen else None  # bound before the imports: a launcher may connect meanwhile
    for name in preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if threading.active_count() != 1 or (torch is not None and torch.cuda.is_initialized()):
        raise SystemExit("fork server: the preloaded modules started a thread or CUDA; forking would not be safe")
    gc.collect()  # and freeze what is left: a child's collections never scan the imports (nor touch, and so copy,
    gc.freeze()  # their pages)
    owner = _Channel(0, 1)
    if listener is not None:
        owner.send({"listening": listen})
    hello = {"hello": {"pid": os.getpid(), "executable": sys.executable, "netns": _namespace("net"),
                       "preload": list(preload), "pythonpath": os.environ.get("PYTHONPATH", "")}}
    launchers: dict[int, _Channel] = {}  # connected ones, by file descriptor
    children: dict[int, _Channel] = {}  # pid -> whom to tell when it exits
    _SERVER_SOCKETS.clear()
    _SERVER_SOCKETS.update({listener.fileno(): listener} if listener is not None else {})
    while owner.open or children:
        if not owner.open and listener is not None:  # the owner is gone: no new launcher, no new child
            listener = _close_listener(listener, listen)
        waiting = [owner.rfd] if owner.open else []
        waiting += [*launchers, *([listener.fileno()] if listener is not None else [])]
        for fd in select.select(waiting, [], [], 0.1)[0]:
            if listener is not None and fd == listener.fileno():
                connection, _ = listener.accept()
                launchers[connection.fileno()] = channel = _Channel(connection.fileno(), connection.fileno(), connection)
                _SERVER_SOCKETS[connection.fileno()] = connection
                channel.send(hello)
            else:
                channel = owner if fd == owner.rfd and owner.open else launchers[fd]
                channel.receive(children)
                if not channel.open and channel is not owner:
                    _SERVER_SOCKETS.pop(fd, None)
                    launchers.pop(fd).close()
        _reap(children)
    if listener is not None:
        _close_listener(listener, listen)


class _Channel:
    """One launcher's requests (``rfd``) and replies (``wfd``): the owner's pipes, or a connection."""

    def __init__(self, rfd: int, wfd: int, connection: socket.socket | None = None):
        self.rfd, self.wfd, self.connection = rfd, wfd, connection
        self.pending, self.open = b"", True

    def receive(self, children: dict[int, _Channel]) -> None:
        try:
            chunk = os.read(self.rfd, 1 << 16)
        except OSError:
            chunk = b""
        self.open = bool(chunk)
        self.pending += chunk
        while b"\n" in self.pending and self.open:
            line, self.pending = self.pending.split(b"\n", 1)
            self.open = _handle(line, self, children)
        if len(self.pending) > MAX_REQUEST_BYTES:  # a request this long is no request of ours
            self.send({"error": f"a request of more than {MAX_REQUEST_BYTES} bytes"})
            self.open = False

    def send(self, message: dict[str, Any]) -> None:
        if self.wfd < 0:
            return
        try:
            data = json.dumps(message).encode() + b"\n"
            while data:
                data = data[os.write(self.wfd, data):]
        except OSError:  # the launcher is gone: its children are stopped by their process groups, not by us
            self.wfd = -1

    def close(self) -> None:
        self.open, self.wfd = False, -1
        if self.connection is not None:
            self.connection.close()


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the socket is its owner's alone: whoever connects runs code as the server
    try:
        listener.bind(path)
    finally:
        os.umask(old_mask)
    listener.listen(64)
    return listener


def _close_listener(listener: socket.socket, path: str | None) -> None:
    _SERVER_SOCKETS.pop(listener.fileno(), None)
    listener.close()
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _namespace(kind: str) -> str:
    """This process's ``kind`` namespace (``net:[4026531840]``): a child forked here lives in the server's."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _handle(line: bytes, channel: _Channel, children: dict[int, _Channel]) -> bool:
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
        channel.send({"error": f"{type(e).__name__}: {e}"})
        return True
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the server's loop
        os.close(started_r)
        for server_socket in _SERVER_SOCKETS.values():  # the server's, not the child's: closed and let go of, so
            with contextlib.suppress(OSError):  # that collecting the objects at its exit closes no descriptor of its
                os.close(server_socket.detach())  # own that took the number meanwhile
        _become(request, out, err)
        os.close(started_w)  # its session exists: a signal to its group from now on reaches it
        try:
            _run(argv)
            code = 0
        except SystemExit as exc:
            code = quick_exit.exit_code(exc)
        quick_exit.exit_now(code)  # what the exit shows others, without the teardown (``quick_exit``)
    os.close(started_w)
    os.read(started_r, 1)  # returns once the child closed its end (or died)
    os.close(started_r)
    for f in (out, err):
        if f is not None:
            f.close()
    children[pid] = channel
    channel.send({"pid": pid})
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


def _reap(children: dict[int, _Channel]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        channel = children.pop(pid, None)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if channel is not None:
            channel.send({"exited": pid, "code": code})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--listen"]:
        serve(sys.argv[3:], listen=sys.argv[2])
    else:
        serve(sys.argv[1:])
