"""The monitor process: a DHT-only peer polling the run's records, and a web server showing them.

    with StopSignal() as stop:
        serve_monitor(MonitorConfig(run="demo", dht=DHTConfig(initial_peers=(maddr,))), stop, on_ready=print)

Routes: ``/`` the page, ``/static/*`` its script and style (packaged with p2ptrain: the page works offline
and loads nothing from elsewhere), ``/api/state`` the view as JSON, ``/metrics`` Prometheus, ``/healthz``.

Web stack: aiohttp. It is asyncio-native, so one event loop (owned by ``serve_monitor``) serves HTTP and
times the polls, as hivemind's own components are asyncio; it is small (no ORM, no templating, no
validation framework), a long-kept aio-libs project, and its client side serves the tests (HTTP and the
browser's DevTools websocket) with no second library. The DHT facade is synchronous, so each poll runs in
a worker thread under the DHT's own request deadline while the loop keeps answering.

Like the bootstrap, the monitor publishes no record, so it is never a member and never leads. It runs in
client mode by default: it asks the DHT, it stores nothing for others, and its going away loses no record.

Peer records are untrusted input. JSON responses carry ``<``, ``>``, ``&`` and ``'`` as ``\\u`` escapes, so no
response holds markup a browser could run even if it sniffed one as HTML; every response has ``nosniff`` and
a strict Content-Security-Policy (scripts and styles from the monitor only, no inline script); and the page
builds its DOM with ``textContent`` only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2ptrain.errors import ConfigError
from p2ptrain.lifecycle import StopSignal
from p2ptrain.monitor.metrics import RunCollector, make_registry
from p2ptrain.monitor.tensorboard import TensorBoardLog
from p2ptrain.monitor.view import RunView, Snapshot, ViewConfig
from p2ptrain.net.dht.keys import RecordKind, check_run_id
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.nat.relay import RelayConfig

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
_STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _monitor_dht() -> DHTConfig:
    return DHTConfig(client_mode=True, relay=RelayConfig(serve=False))


@dataclass(frozen=True)
class MonitorConfig:
    run: str
    dht: DHTConfig = field(default_factory=_monitor_dht)
    host: str = "127.0.0.1"  # 0.0.0.0 to show the page to other machines
    port: int = 8080  # 0: any free port (the printed URL says which)
    poll_s: float = 2.0  # how often the run's records are read
    tokens_per_step: int | None = None  # global batch × sequence length, for tokens/s
    time_scale: float | None = None  # an emulated network's factors (``p2ptrain swarm``), else None
    size_factor: float | None = None
    silent_after_s: float = 30.0  # a trainer whose heartbeat has not moved for this long is "silent"
    announce_file: str | None = None  # also write the URL here (atomically); removed on exit
    tensorboard_dir: str | None = None  # also write the run's progress as TensorBoard event files here

    def __post_init__(self) -> None:
        try:
            check_run_id(self.run)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535")
        if not self.poll_s > 0 or not self.silent_after_s > 0:
            raise ConfigError("poll_s and silent_after_s must be positive")
        if self.tokens_per_step is not None and self.tokens_per_step < 1:
            raise ConfigError(f"tokens_per_step={self.tokens_per_step} must be at least 1")
        for name in ("time_scale", "size_factor"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ConfigError(f"{name}={value} must be a positive number")

    def view_config(self) -> ViewConfig:
        emulated = self.time_scale is not None or self.size_factor is not None
        return ViewConfig(run=self.run, tokens_per_step=self.tokens_per_step, time_scale=self.time_scale or 1.0,
                          size_factor=self.size_factor or 1.0, emulated=emulated,
                          silent_after_s=self.silent_after_s)


def read_snapshot(dht: SwarmDHT) -> Snapshot:
    """The run's verified records now (``SwarmDHT.read``: each under the DHT's request deadline). Peers are
    read without dialling anyone: the monitor only looks."""
    records = {kind: {p: v.record for p, v in dht.read(kind).items()} for kind in RecordKind}
    return Snapshot(time=time.time(), peers=records[RecordKind.PEER], links=records[RecordKind.LINKS],
                    plans=records[RecordKind.PLAN], progress=records[RecordKind.PROGRESS])  # type: ignore[arg-type]


def dumps_safe(document: Any) -> str:
    """JSON with no character that means something to HTML: ``<``, ``>``, ``&`` and ``'`` become ``\\uXXXX``
    escapes (still the same strings to a JSON parser)."""
    text = json.dumps(document, allow_nan=False, separators=(",", ":"))
    for char in "<>&'":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


class MonitorApp:
    """The view, the poller that feeds it, and the web routes over it (all on one event loop)."""

    def __init__(self, config: MonitorConfig, read: Callable[[], Snapshot]):
        self.config = config
        self.view = RunView(config.view_config())
        self.errors = 0
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-monitor-poll")
        self.registry = make_registry(RunCollector(self.state, lambda: self.errors))
        self.tensorboard = TensorBoardLog(config.tensorboard_dir) if config.tensorboard_dir else None

    def state(self) -> dict[str, Any]:
        return {**self.view.state(time.time()), "poll_errors": self.errors}

    async def poll_forever(self, stop: StopSignal) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.view.update(await loop.run_in_executor(self._pool, self._read))
                if self.tensorboard is not None:
                    self.tensorboard.write(self.state())
                if failing:
                    logger.info("reading the run's records works again")
                failing = False
            except Exception as e:  # a slow or failed DHT read: count it, say so once, try again next period
                self.errors += 1
                (logger.debug if failing else logger.warning)(
                    "reading the run's records failed (%s: %s); retrying every %g s, the page shows what was read",
                    type(e).__name__, e, self.config.poll_s)
                failing = True
            while not stop.is_set() and time.monotonic() - started < self.config.poll_s:
                await asyncio.sleep(min(0.1, self.config.poll_s))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.tensorboard is not None:
            self.tensorboard.close(self.state())

    def web_app(self) -> web.Application:
        app = web.Application(middlewares=[_security_headers])
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._api_state)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        return app

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=(STATIC_DIR / "index.html").read_bytes(), content_type="text/html", charset="utf-8")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        path = STATIC_DIR / name
        content_type = _STATIC_TYPES.get(path.suffix)
        if content_type is None or "/" in name or name.startswith(".") or not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes(), content_type=content_type, charset="utf-8")

    async def _api_state(self, request: web.Request) -> web.Response:
        return web.Response(text=dumps_safe(self.state()), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text=dumps_safe({"ok": True, "polls": self.view.polls, "errors": self.errors}),
                            content_type="application/json")


@web.middleware
async def _security_headers(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response


def serve_monitor(config: MonitorConfig, stop: StopSignal, on_ready: Callable[[str], None]) -> None:
    """Join the run's DHT (tried again while none of the initial peers answers, within the DHT's
    ``startup_timeout_s``, as an agent does: ``SwarmDHT.join``), serve the page until ``stop`` is set;
    ``on_ready(url)`` once it answers."""
    from p2ptrain.net.dht.bootstrap import write_atomically

    with SwarmDHT.join(config.run, config.dht, stopped=stop.is_set) as dht:
        logger.info("monitor peer %s reading run %r", dht.peer_id, config.run)
        app = MonitorApp(config, lambda: read_snapshot(dht))
        announce = Path(config.announce_file) if config.announce_file else None

        def ready(url: str) -> None:
            if announce is not None:
                write_atomically(announce, url + "\n")
            on_ready(url)

        try:
            asyncio.run(_serve(app, stop, ready))
        finally:
            app.close()
            if announce is not None:
                announce.unlink(missing_ok=True)


async def _serve(app: MonitorApp, stop: StopSignal, on_ready: Callable[[str], None]) -> None:
    cfg = app.config
    runner = web.AppRunner(app.web_app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        try:
            await site.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror}; pick another --port") from None
        port = runner.addresses[0][1]
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host
        host = f"[{host}]" if ":" in host else host
        poller = asyncio.create_task(app.poll_forever(stop))
        on_ready(f"http://{host}:{port}/")
        logger.info("serving the run's page on %s:%d; stop with SIGTERM or Ctrl-C", cfg.host, port)
        await poller
        logger.info("stopping (%s)", stop.reason)
    finally:
        await runner.cleanup()
