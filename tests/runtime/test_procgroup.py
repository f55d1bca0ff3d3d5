import os
import signal
import sys
import textwrap
import time

import psutil
import pytest

from p2ptrain.runtime.procgroup import ChildFailed, ProcessGroup

# A child that starts a grandchild ignoring SIGTERM, then sleeps: stopping the child must take both.
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"])
    time.sleep(600)
    """
)


@pytest.mark.timeout(30)
def test_stop_takes_the_whole_process_group(tmp_path):
    with ProcessGroup(grace_s=1.0) as group:
        child = group.start("stubborn", [sys.executable, "-c", STUBBORN], log_path=tmp_path / "log")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not psutil.Process(child.pid).children():
            time.sleep(0.05)
        grandchildren = psutil.Process(child.pid).children()
        assert grandchildren, "the grandchild never started"
        group.stop("stubborn")
        gone, alive = psutil.wait_procs(grandchildren, timeout=5)
        assert not alive
        assert child.poll() == -signal.SIGTERM


@pytest.mark.timeout(30)
def test_wait_all_reports_the_failing_child(tmp_path):
    with ProcessGroup(grace_s=1.0) as group:
        group.start("ok", [sys.executable, "-c", "import time; time.sleep(30)"])
        group.start("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], log_path=tmp_path / "bad.log")
        with pytest.raises(ChildFailed, match="bad exited with code 3"):
            group.wait_all(deadline_s=20)
    assert group.running() == []


@pytest.mark.timeout(30)
def test_wait_all_deadline_names_the_slow_child():
    with ProcessGroup(grace_s=1.0) as group:
        group.start("slow", [sys.executable, "-c", "import time; time.sleep(30)"])
        with pytest.raises(ChildFailed, match="slow still running"):
            group.wait_all(deadline_s=0.5, tick_s=0.1)


@pytest.mark.timeout(60)
def test_a_frozen_child_is_continued_to_take_its_sigterm_not_killed_after_the_grace(tmp_path):
    with ProcessGroup(grace_s=30.0) as group:
        child = group.start("frozen", [sys.executable, "-c", "import time; time.sleep(600)"], log_path=tmp_path / "log")
        os.killpg(child.pid, signal.SIGSTOP)  # a frozen machine: a pending SIGTERM waits for SIGCONT
        assert group.stop("frozen") == -signal.SIGTERM  # SIGTERM then SIGCONT; the grace would end in SIGKILL
