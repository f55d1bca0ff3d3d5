"""Clean process lifecycle: SIGTERM/SIGINT become a stop flag, and shutdown runs in order, with deadlines.

Why this is needed with hivemind: a ``hivemind.DHT`` is a forked child process that owns a Go ``p2pd``
grandchild. A SIGTERM with Python's default handler kills the main process at once and orphans both;
``DHT.shutdown()`` in turn, if the child does not stop within its grace period, SIGTERMs the child, which
then dies without stopping its p2pd. So entry points (bootstrap, agent, swarm) do::

    with StopSignal() as stop:              # SIGTERM/SIGINT now set a flag instead of killing us
        with SwarmDHT(run_id, cfg) as dht:  # SwarmDHT.shutdown also reaps a p2pd left behind
            while not stop.wait(period_s):
                ...                          # work, heartbeats
    # leaving the blocks shuts down the DHT and p2pd, then restores the previous handlers

Forked children inherit Python signal handlers. A child that is not the process which installed the
handler restores the default action and re-raises the signal, so ``terminate()`` on a child still ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from hivemind.p2p.p2p_daemon_bindings.utils import DispatchFailure

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Turns the given signals into a flag; ``wait(timeout_s)`` returns True once one arrived.

    Install from the main thread (Python delivers signals there). A second signal while stopping is logged
    and otherwise ignored: shutdown steps have their own deadlines, so it cannot hang for long.

    The handler itself only writes a byte to a pipe (async-signal-safe); a thread of ours reads it, logs, and
    sets the flag. Setting a ``threading.Event`` inside the handler deadlocks when the signal lands while the
    main thread is entering ``wait`` on that same event (it holds the event's plain lock for a moment): CI
    saw a bootstrap that got Ctrl-C just as it started serving never stop.
    """

    def __init__(self, signals: Iterable[signal.Signals] = STOP_SIGNALS):
        self._signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[signal.Signals, object] = {}
        self._owner_pid = os.getpid()
        self.reason: str | None = None
        self._received: list[str] = []  # signal names, appended by the handler, taken by the relay thread
        self._wake_fd: int | None = None

    def install(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal must be installed from the main thread")
        self._owner_pid = os.getpid()
        read_fd, self._wake_fd = os.pipe()
        threading.Thread(target=self._relay, args=(read_fd,), name="p2ptrain-signals", daemon=True).start()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._wake_fd is not None:  # the relay thread reads end-of-file and ends
            os.close(self._wake_fd)
            self._wake_fd = None

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def set(self, reason: str = "stop requested") -> None:
        """Request a stop without a signal (another thread, a fatal error in the main loop)."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._event.wait(timeout_s)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner_pid:  # a forked child inherited this handler: behave as default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._received.append(signal.Signals(signum).name)
        if self._wake_fd is not None:
            try:
                os.write(self._wake_fd, b"\0")
            except OSError:  # restored meanwhile: the signal came too late to matter
                pass

    def _relay(self, read_fd: int) -> None:
        """Turn each byte the handler wrote into the stop flag, off the main thread (see the class)."""
        try:
            while os.read(read_fd, 1):
                name = self._received.pop(0) if self._received else "a signal"
                if self._event.is_set():
                    logger.warning("received %s again; already stopping", name)
                    continue
                logger.info("received %s, stopping", name)
                self.set(f"received {name}")
        finally:
            os.close(read_fd)


def service_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a thread that serves libp2p streams, quiet about the streams it cancels.

    At shutdown the serving loop cancels hivemind's per-stream handler tasks. CPython 3.11's
    ``StreamReaderProtocol`` then asks each cancelled task for its exception in a done-callback, which
    raises ``CancelledError`` there, and the loop logs that as an error with a traceback, once per stream
    that was open (a persistent tensor stream, a forwarded one). Nothing failed: such a report is logged at
    debug level. Two reports from hivemind's daemon bindings become one line without a traceback: a stream
    that arrives for a protocol whose handler was just removed (at shutdown; debug), and the control
    connection to the libp2p daemon closing (the daemon stopped: at shutdown, or it died; a warning). Every
    other exception goes to asyncio's default handler."""
    loop = asyncio.new_event_loop()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exception = context.get("exception")
        if isinstance(exception, asyncio.CancelledError):
            logger.debug("a stream handler was cancelled: %s", context.get("message"))
            return
        if isinstance(exception, DispatchFailure):
            logger.debug("a stream for protocol %s came after its handler was removed", exception)
            return
        task = context.get("future")
        coroutine = task.get_coro() if isinstance(task, asyncio.Task) else None
        daemon = getattr(coroutine, "__qualname__", "").startswith("ControlClient.")  # hivemind's daemon client
        if daemon and isinstance(exception, ConnectionError | asyncio.IncompleteReadError):
            logger.warning("the connection to this peer's libp2p daemon closed (%r)", exception)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return loop


def shutdown_in_order(steps: Iterable[tuple[str, Callable[[], object]]]) -> list[str]:
    """Run named shutdown steps in order, logging each; a failing step is logged and the rest still run.

    Returns the names of the steps that raised. Each step must bound its own duration.
    """
    failed = []
    for name, step in steps:
        start = time.monotonic()
        try:
            step()
        except Exception:
            logger.exception("shutdown step %r failed", name)
            failed.append(name)
        else:
            logger.debug("shutdown step %r done in %.2f s", name, time.monotonic() - start)
    return failed


def find_processes(expected_name: str, cmdline_contains: bytes) -> list[int]:
    """Pids of running processes named ``expected_name`` whose command line contains ``cmdline_contains``.

    Linux only (reads ``/proc``); elsewhere returns an empty list.
    """
    if not os.path.isdir("/proc"):
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if cmdline_contains in cmdline and _is_running(int(entry), expected_name):
            found.append(int(entry))
    return found


def terminate_stray_process(pid: int, expected_name: str, timeout_s: float) -> bool:
    """SIGTERM, then SIGKILL after ``timeout_s``, a process that is not our child (e.g. an orphaned p2pd).

    The process is only signalled while ``/proc/<pid>/cmdline`` still names ``expected_name`` (where
    ``/proc`` exists), so a reused pid is left alone. Returns True if such a process was found running.
    """
    if not _is_running(pid, expected_name):
        return False
    logger.warning("%s (pid %d) is still running after shutdown; terminating it", expected_name, pid)
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, timeout_s)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _is_running(pid, expected_name):
                return True
            time.sleep(0.05)
    logger.error("%s (pid %d) survived SIGKILL", expected_name, pid)
    return True


def _is_running(pid: int, expected_name: str) -> bool:
    if not os.path.isdir("/proc"):  # no procfs (macOS): all we can tell is whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return expected_name.encode() in cmdline and state not in (b"Z", b"X")


@contextlib.contextmanager
def logger_levels(levels: dict[str, int]) -> Iterator[None]:
    """Each named logger at its level inside the block, as it was after: a command quiets the library for its own
    run (``click.Context.with_resource``), so that one run in-process (a test, another program) leaves logging as
    it found it."""
    before = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
