"""Headless Chromium (Debian's ``chromium`` package) driven over the DevTools protocol, for the page tests.

    with Chromium(tmp_path) as chrome:
        asyncio.run(chrome.visit(url, check))    # check(page) evaluates JavaScript, waits, takes screenshots

Skipped where no Chromium is installed (``CHROMIUM_MISSING`` says why); ``.ci/run`` installs it. The DevTools
websocket is spoken with aiohttp's client (a dependency already), so the test needs no driver package.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_MISSING = "no Chromium on this machine (apt-get install chromium; .ci/run installs it)"


class Page:
    """One tab: ``call`` a DevTools method, ``evaluate`` JavaScript, ``wait_for`` a condition, ``screenshot``."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.events: list[dict[str, Any]] = []  # DevTools events received while waiting for replies
        self._id = 0

    async def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        ident = self._id
        await self.ws.send_json({"id": ident, "method": method, "params": params})

        async def reply() -> dict[str, Any]:
            while True:
                msg = await self.ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"the DevTools connection closed ({msg.type.name}) during {method}")
                data = json.loads(msg.data)
                if data.get("id") == ident:
                    if "error" in data:
                        raise RuntimeError(f"{method}: {data['error']}")
                    return data["result"]
                if "method" in data:
                    self.events.append(data)

        return await asyncio.wait_for(reply(), timeout_s)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.5)
        raise AssertionError(f"{what} did not happen within {timeout_s} s (page: {await self.evaluate(_BODY_TEXT)})")

    async def screenshot(self, path: Path, width: int = 1400) -> None:
        """The whole page as a PNG."""
        height = int(await self.evaluate("document.documentElement.scrollHeight"))
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        data = await self.call("Page.captureScreenshot", timeout_s=60.0, format="png")
        path.write_bytes(base64.b64decode(data["data"]))

    def exceptions(self) -> list[str]:
        """Uncaught JavaScript exceptions the page threw so far."""
        return [json.dumps(e["params"])[:500] for e in self.events if e["method"] == "Runtime.exceptionThrown"]


_BODY_TEXT = "document.body ? document.body.innerText.slice(0, 400) : ''"


class Chromium:
    """A headless Chromium with its own profile under ``workdir``, stopped (its whole process group) on exit."""

    def __init__(self, workdir: Path, startup_timeout_s: float = 90.0):
        assert CHROMIUM is not None, CHROMIUM_MISSING
        self.profile = workdir / "chromium-profile"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> Chromium:
        self.profile.mkdir(parents=True, exist_ok=True)
        log = open(self.profile.parent / "chromium.log", "wb")  # noqa: SIM115 - closed with the process
        flags = ["--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                 "--disable-dev-shm-usage", "--disable-extensions", "--remote-debugging-port=0",
                 f"--user-data-dir={self.profile}", "--window-size=1400,1000"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.startup_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"Chromium did not start: {(self.profile.parent / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.2)
        self.port = int(port_file.read_text().split()[0])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                time.sleep(0.5)  # its helpers (zygote, renderers) leave with it; give them a moment
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any helper that outlived the browser process
        except ProcessLookupError:
            pass

    async def visit(self, url: str, check: Callable[[Page], Awaitable[Any]]) -> Any:
        """Open ``url`` in the browser's tab and run ``check`` on it."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.get(f"http://127.0.0.1:{self.port}/json/list") as response:
                targets = await response.json()
            target = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.call("Page.enable")
                await page.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1,
                                mobile=False)
                await page.call("Page.navigate", url=url)
                return await check(page)
