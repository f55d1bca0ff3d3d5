"""Signals become a stop flag in the process that asked for it, and default behaviour in forked children."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.lifecycle import (
    StopSignal,
    find_processes,
    service_loop,
    shutdown_in_order,
    terminate_stray_process,
)


@pytest.mark.timeout(10)
def test_sigterm_and_sigint_set_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        assert not stop.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5.0)
        assert stop.reason == "received SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping is only logged
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(10)
def test_a_signal_that_lands_while_the_main_thread_holds_the_flags_lock_does_not_deadlock():
    # the main thread entering ``stop.wait`` holds the event's plain lock for a moment; a handler that set the
    # event itself would block on that lock for ever (a bootstrap given Ctrl-C as it started serving hung so)
    with StopSignal() as stop:
        with stop._event._cond:  # noqa: SLF001 - where the main thread is when the signal lands
            stop._handle(signal.SIGINT, None)  # noqa: SLF001 - the handler as Python would run it here
        assert stop.wait(5.0) and stop.reason == "received SIGINT"


def _sleep_forever(running) -> None:
    running.set()
    time.sleep(60)


@pytest.mark.timeout(20)
def test_a_forked_child_still_dies_on_sigterm():
    context = mp.get_context("fork")
    with StopSignal():
        running = context.Event()
        child = context.Process(target=_sleep_forever, args=(running,))
        child.start()
        assert running.wait(10), "the child never ran"
        child.terminate()  # SIGTERM: the inherited handler must not swallow it
        child.join(10)
    state = "" if child.exitcode is not None else _signal_state(child.pid)  # what held it (CI saw one live, once)
    if child.exitcode is None:
        child.kill()
        child.join(5)
    assert child.exitcode == -signal.SIGTERM, state


def _signal_state(pid: int) -> str:
    """The kernel's view of a process that outlived its SIGTERM: its state and signal masks, and where it waits."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"no /proc view of {pid}: {e}"
    keep = ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Threads")
    return "; ".join(line for line in status if line.split(":")[0] in keep) + f"; wchan {wchan}"


def test_shutdown_steps_all_run_even_if_one_fails():
    ran = []

    def boom() -> None:
        raise RuntimeError("boom")

    failed = shutdown_in_order([("a", lambda: ran.append("a")), ("b", boom), ("c", lambda: ran.append("c"))])
    assert failed == ["b"] and ran == ["a", "c"]


@pytest.mark.timeout(20)
def test_a_stray_process_is_found_by_its_command_line_and_terminated():
    marker = f"p2ptrain-test-{os.getpid()}-{time.monotonic_ns()}"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, marker], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"  # SIGTERM is ignored from here on
        assert find_processes("python", marker.encode()) == [proc.pid]
        assert not terminate_stray_process(
            proc.pid, "no-such-name", 1.0
        )  # a pid of another program is left alone
        assert terminate_stray_process(proc.pid, "python", 0.5)  # ignores SIGTERM: SIGKILL follows
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def _serve_and_cancel(loop) -> None:
    """A stream server whose handler is cancelled mid-stream (as a transport's shutdown does), then a
    callback that fails for real."""

    async def scenario() -> None:
        serving = asyncio.Event()

        async def handler(reader, writer) -> None:
            serving.set()
            await reader.read()  # until cancelled

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(serving.wait(), 10)
        handlers = asyncio.all_tasks() - {asyncio.current_task()}
        for task in handlers:
            task.cancel()
        _, pending = await asyncio.wait(handlers, timeout=10)  # each ended, and its done-callbacks ran first
        assert not pending
        writer.close()
        server.close()
        failed = loop.create_future()
        loop.call_soon(lambda: 1 / 0)
        loop.call_soon(failed.set_result, None)  # callbacks run in order: once this one has, the failure ran
        await failed

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


def test_a_service_loop_is_quiet_about_cancelled_stream_handlers_and_reports_real_errors(caplog):
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _serve_and_cancel(asyncio.new_event_loop())
    plain = [r for r in caplog.records if r.exc_info]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _serve_and_cancel(service_loop())
    quiet = [r for r in caplog.records if r.exc_info]
    assert [r.exc_info[0] for r in quiet] == [ZeroDivisionError]
    if sys.version_info < (3, 12):  # CPython 3.11's StreamReaderProtocol reports the cancelled handler
        assert {r.exc_info[0] for r in plain} == {asyncio.CancelledError, ZeroDivisionError}


class ControlClient:  # named as hivemind's daemon client, whose persistent connection reader this stands for
    async def _read_from_persistent_conn(self) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_service_loop_reports_hivemind_daemon_connection_ends_in_one_line(caplog):
    from hivemind.p2p.p2p_daemon_bindings.utils import DispatchFailure

    loop = service_loop()

    async def scenario() -> None:
        task = asyncio.ensure_future(ControlClient()._read_from_persistent_conn())  # its exception never read
        await asyncio.wait([task], timeout=10)
        assert task.done()
        del task
        gc.collect()  # asyncio reports an unretrieved task exception when the task is collected
        loop.call_exception_handler({"message": "Unhandled exception in client_connected_cb",
                                     "exception": DispatchFailure("p2ptrain::tensor.rpc_probe")})

    try:
        # the package's level too: it is whatever an earlier test of this process left it at
        with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="p2ptrain"):
            loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "p2ptrain.lifecycle"]
    assert (logging.WARNING, "the connection to this peer's libp2p daemon closed "
            "(ConnectionResetError(104, 'Connection reset by peer'))") in lines
    assert (logging.DEBUG, "a stream for protocol p2ptrain::tensor.rpc_probe came after its handler was removed") \
        in lines
