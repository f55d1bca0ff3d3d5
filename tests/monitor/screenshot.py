"""Take the README's screenshot of the monitor: run a local swarm with ``--monitor``, and once it has trained
all but its last steps, photograph the page in headless Chromium::

    python tests/monitor/screenshot.py docs/monitor.png --agents 8 --stages 4 --scenario worldwide --steps 30

Everything after the output path goes to ``p2ptrain swarm``. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from browser import Chromium  # noqa: E402


def main(out: Path, swarm_args: list[str]) -> int:
    steps = int(swarm_args[swarm_args.index("--steps") + 1])
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-screenshot-"))
    swarm = subprocess.Popen([sys.executable, "-m", "p2ptrain", "swarm", "--workdir", str(workdir), "--monitor",
                              *swarm_args], stdout=subprocess.DEVNULL)
    try:
        url = None
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and swarm.poll() is None:
            time.sleep(1)
            try:
                url = url or json.loads((workdir / "swarm.json").read_text()).get("monitor", {}).get("url")
                if url is None:
                    continue
                with urllib.request.urlopen(url + "api/state", timeout=10) as response:
                    state = json.loads(response.read())
            except (OSError, ValueError):
                continue
            print(f"step {state['summary']['step']}/{steps}", file=sys.stderr)
            if state["summary"]["step"] >= steps - 1:
                break
        else:
            print("the swarm ended or stalled before its last steps", file=sys.stderr)
            return 1

        async def shoot(page):
            await page.wait_for("document.querySelectorAll('#loss-chart circle.point').length > 0", 60, "the page")
            await asyncio.sleep(2)
            await page.screenshot(out)

        with Chromium(workdir) as chrome:
            asyncio.run(chrome.visit(url, shoot))
        print(f"wrote {out}", file=sys.stderr)
    finally:
        if swarm.poll() is None:
            swarm.terminate()  # SIGTERM: the swarm stops every process it started
        swarm.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve(), sys.argv[2:]))
