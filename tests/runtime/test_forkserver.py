"""The fork server starts Python processes as Popen would, from one process that imported their modules."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from p2ptrain.runtime.forkserver import (
    MAX_REQUEST_BYTES,
    SHARED_ENV,
    ForkedProcess,
    ForkServer,
    start_shared,
    stop_shared,
    unfit,
)
from p2ptrain.runtime.procgroup import ProcessGroup

SCRIPT = textwrap.dedent(
    """
    import json, os, random, sys
    import torch
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_TEST"),
                      "sid": os.getsid(0) == os.getpid(), "main": __name__, "random": random.random(),
                      "torch": torch.rand(1).item(), "stdin": sys.stdin.read()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.timeout(120)
def test_a_forked_script_runs_as_its_own_process_with_our_environment_files_and_exit_code(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("FORKED_TEST", "as set when spawned")  # after the server started: the call's env counts
    server = ForkServer(["torch"], log_path=tmp_path / "server.log", share=False).start()
    try:
        children = [server.spawn([sys.executable, str(script), str(code)], cwd=work, stdout_path=tmp_path / f"out{code}",
                                 stderr_path=tmp_path / f"err{code}") for code in (0, 3)]
        assert [c.wait(timeout=60) for c in children] == [0, 3]
        outs = [json.loads((tmp_path / f"out{code}").read_text()) for code in (0, 3)]
        for code, out in zip((0, 3), outs, strict=True):
            assert out["argv"] == [str(script), str(code)] and out["main"] == "__main__"
            assert out["cwd"] == str(work) and out["env"] == "as set when spawned" and out["sid"] and out["stdin"] == ""
            assert (tmp_path / f"err{code}").read_text() == "to stderr\n"
        assert outs[0]["random"] != outs[1]["random"] and outs[0]["torch"] != outs[1]["torch"]  # fresh seeds

        # a module, signalled: Popen's negative code; a command it does not run is refused before any fork
        sleeper = server.spawn([sys.executable, "-m", "http.server", "0"], stderr_path=tmp_path / "http.log")
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.2)
        os.killpg(sleeper.pid, signal.SIGTERM)  # its own session: the group is the child's
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
        with pytest.raises(ValueError, match="runs 'python -m MODULE'"):
            server.spawn([sys.executable, "-c", "pass"])
        with pytest.raises(RuntimeError, match="could not start"):
            server.spawn([sys.executable, str(script), "0"], stdout_path=tmp_path / "no" / "such" / "dir")
        # a process forked from ours since (as hivemind forks its DHT) holds the server's input open: the server
        # ends because it is told to, not because its input ends
        holder = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
        holder.start()
    finally:
        server.close(timeout_s=30)
    holder.terminate()
    assert server._popen.returncode == 0  # noqa: SLF001 - it ended on its own, not killed after the timeout


@pytest.mark.timeout(120)
def test_a_group_forks_python_children_and_starts_other_commands_as_before(tmp_path, monkeypatch):
    monkeypatch.delenv(SHARED_ENV, raising=False)  # a server of the group's own
    with ProcessGroup(grace_s=5.0) as group:
        group.use_fork_server(["json"], log_path=tmp_path / "server.log")
        forked = group.start("forked", [sys.executable, "-m", "json.tool", "--help"], log_path=tmp_path / "f.log",
                             fork=True)
        plain = group.start("plain", ["sh", "-c", "exit 4"], log_path=tmp_path / "p.log", fork=True)
        assert forked.popen.wait(timeout=60) == 0 and "json.tool" in (tmp_path / "f.log").read_text()
        assert plain.popen.wait(timeout=60) == 4 and isinstance(plain.popen, subprocess.Popen)
        stuck = group.start("stuck", [sys.executable, "-m", "http.server", "0"], log_path=tmp_path / "s.log", fork=True)
        assert isinstance(stuck.popen, ForkedProcess) and group.stop("stuck") == -signal.SIGTERM
    assert group.fork_server._popen.poll() == 0  # noqa: SLF001 - closed with the group, after its children


HOLDER = textwrap.dedent(
    """
    import time
    from hivemind.utils.mpfuture import MPFuture, SharedBytes
    MPFuture._update_lock.acquire()  # as a DHT process sending a result, or an agent making a future, would
    SharedBytes._lock.acquire()
    print("holding", flush=True)
    time.sleep(120)
    """
)
TAKER = textwrap.dedent(
    """
    import multiprocessing, sys
    from hivemind.utils.mpfuture import MPFuture
    future = MPFuture()  # made here, fulfilled by a process forked from here: hivemind's DHT round trip
    child = multiprocessing.get_context("fork").Process(target=future.set_result, args=(42,))
    child.start()
    try:
        print(future.result(timeout=20))
    except TimeoutError:
        sys.exit("the result never came: a lock of another process held it up")
    child.join(10)
    """
)


@pytest.mark.timeout(180)
def test_a_child_killed_holding_hivemind_locks_does_not_hang_its_siblings(tmp_path):
    # hivemind makes multiprocessing locks when imported; processes forked from one server would share them:
    # an agent SIGKILLed while it held one hung the DHT of every other agent of a local swarm
    (tmp_path / "holder.py").write_text(HOLDER)
    (tmp_path / "taker.py").write_text(TAKER)
    server = ForkServer(["hivemind.utils.mpfuture"], log_path=tmp_path / "server.log", share=False).start()
    try:
        holder = server.spawn([sys.executable, str(tmp_path / "holder.py")], stdout_path=tmp_path / "holder.out",
                              stderr_path=tmp_path / "holder.err")
        deadline = time.monotonic() + 60
        while "holding" not in (tmp_path / "holder.out").read_text():
            assert holder.poll() is None, (tmp_path / "holder.err").read_text()
            assert time.monotonic() < deadline, "the holder did not take the locks within 60 s"
            time.sleep(0.1)
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding them, as ``p2ptrain swarm --kill`` kills an agent
        assert holder.wait(timeout=30) == -signal.SIGKILL
        taker = server.spawn([sys.executable, str(tmp_path / "taker.py")], stdout_path=tmp_path / "taker.out",
                             stderr_path=tmp_path / "taker.err")
        assert taker.wait(timeout=40) == 0, (tmp_path / "taker.err").read_text()
        assert (tmp_path / "taker.out").read_text() == "42\n"
    finally:
        server.close(timeout_s=30)


@pytest.mark.timeout(120)
def test_launchers_share_one_server_that_fits_and_each_hears_of_its_own_children(tmp_path, monkeypatch):
    path = tmp_path / "forks.sock"
    shared = start_shared(["json"], path, log_path=tmp_path / "shared.log")
    try:
        monkeypatch.setenv(SHARED_ENV, str(path))
        first, second = (ForkServer(["json"], log_path=tmp_path / f"launcher{k}.log").start() for k in (1, 2))
        assert first.attached and second.attached and first.pid == second.pid == shared.pid
        assert oct(path.stat().st_mode & 0o777) == "0o600"  # its owner's alone: whoever connects runs code
        assert "forked by the shared fork server" in (tmp_path / "launcher1.log").read_text()
        # a child holds none of the server's sockets (the listener, the launchers' connections): objects still
        # owning their numbers would close whatever of the child's took them, when collected at its exit
        (tmp_path / "sockets.py").write_text("import gc, socket\nprint(sum(isinstance(o, socket.socket) and "
                                             "o.fileno() != -1 for o in gc.get_objects()))\n")
        counted = first.spawn([sys.executable, str(tmp_path / "sockets.py")], stdout_path=tmp_path / "sockets.out")
        assert counted.wait(timeout=60) == 0 and (tmp_path / "sockets.out").read_text() == "0\n"
        sleeper = first.spawn([sys.executable, "-m", "http.server", "0"], stderr_path=tmp_path / "http.log")
        quick = second.spawn([sys.executable, "-m", "json.tool", "--help"], stdout_path=tmp_path / "quick.out")
        assert quick.wait(timeout=60) == 0 and "json.tool" in (tmp_path / "quick.out").read_text()
        assert sleeper.poll() is None  # its exit would come to the first launcher, which has heard nothing
        second.close()  # one launcher done: the server goes on for the others
        os.killpg(sleeper.pid, signal.SIGTERM)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM

        # a line that is no request, and one far too long, are refused; the server serves the next launcher
        with socket.socket(socket.AF_UNIX) as rogue:
            rogue.connect(str(path))
            replies = rogue.makefile("rb")
            assert b"hello" in replies.readline()
            rogue.sendall(b"not json\n")
            assert b"error" in replies.readline()
            rogue.sendall(b"x" * (MAX_REQUEST_BYTES + 1))  # all read before it refuses: its reply is not reset
            assert b"more than" in replies.readline() and replies.readline() == b""
        # a launcher that would preload what the server did not starts its own
        own = ForkServer(["json", "csv"]).start()
        assert not own.attached and own.pid != shared.pid
        own.close()
        third = ForkServer(["json"]).start()
        assert third.attached and third.spawn([sys.executable, "-m", "json.tool", "--help"]).wait(timeout=60) == 0
        third.close()
        first.close()
    finally:
        stop_shared(shared)
    assert shared.returncode == 0 and not path.exists()


def test_a_shared_server_of_another_network_interpreter_or_path_does_not_fit():
    from p2ptrain.runtime.forkserver import _namespace

    hello = {"pid": 7, "executable": sys.executable, "netns": _namespace("net"), "preload": ["json", "csv"],
             "pythonpath": os.environ.get("PYTHONPATH", "")}
    assert unfit(hello, ["json"]) is None
    assert "did not preload csv" in unfit({**hello, "preload": ["json"]}, ["json", "csv"])
    assert "network namespace" in unfit({**hello, "netns": "net:[1]"}, ["json"])  # its children: not on our network
    assert "executable" in unfit({**hello, "executable": "/other/python"}, ["json"])
    assert "PYTHONPATH" in unfit({**hello, "pythonpath": "/elsewhere"}, ["json"])
    assert unfit(None, []) == "it did not say hello" and "pid" in unfit({**hello, "pid": "7"}, [])
