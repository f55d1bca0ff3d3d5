"""What this agent's device can do: its name, memory and measured matmul throughput, cached.

The measurement is a float32 matmul benchmark (square matrices, repeated for ``measure_s``). A result
depends on the device, the torch build, p2ptrain's benchmark and, on a CPU, the number of torch threads,
so the cache (``<cache dir>/device_profiles.json``, written atomically) is keyed by all four; the cache
dir is ``$XDG_CACHE_HOME/p2ptrain`` or ``~/.cache/p2ptrain`` unless configured. A broken cache file is
ignored and rewritten.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from p2ptrain import __version__

logger = logging.getLogger(__name__)

CACHE_FILE = "device_profiles.json"


@dataclass(frozen=True)
class DeviceProfile:
    device_name: str
    memory_gb: float
    tflops: float  # measured float32 matmul throughput
    cached: bool = False


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "p2ptrain"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model or platform.processor() or platform.machine() or 'unknown'}"[:128]


def device_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 1.0


def measure_tflops(device: torch.device, measure_s: float) -> float:
    """Float32 matmul TFLOP/s: the best of short timed rounds within ``measure_s``."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best_s, deadline, reps = float("inf"), time.perf_counter() + measure_s, 4
    torch.matmul(a, b)  # warm up
    while True:
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        _sync(device)
        best_s = min(best_s, (time.perf_counter() - start) / reps)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best_s / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_device(
    device: torch.device, *, cache_dir: Path | None = None, refresh: bool = False, measure_s: float = 0.5
) -> DeviceProfile:
    """This device's profile, from the cache when it has one for the same device, torch, p2ptrain and
    thread count; measured (and cached) otherwise."""
    name = device_name(device)
    key = f"{name}|torch={torch.__version__}|p2ptrain={__version__}"
    if device.type == "cpu":
        key += f"|threads={torch.get_num_threads()}"
    path = (cache_dir or default_cache_dir()) / CACHE_FILE
    cache = _read_cache(path)
    entry = cache.get(key)
    if not refresh and _valid(entry):
        logger.info("device %s: %.3f TFLOP/s, %.1f GB (cached in %s)", name, entry["tflops"], entry["memory_gb"], path)
        return DeviceProfile(name, float(entry["memory_gb"]), float(entry["tflops"]), cached=True)
    profile = DeviceProfile(name, device_memory_gb(device), measure_tflops(device, measure_s))
    logger.info("device %s: measured %.3f TFLOP/s, %.1f GB", name, profile.tflops, profile.memory_gb)
    cache[key] = {k: v for k, v in asdict(profile).items() if k != "cached"}
    _write_cache(path, cache)
    return profile


def _valid(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), int | float) and entry[k] > 0 for k in ("tflops", "memory_gb"))
    )


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop an agent
        tmp.unlink(missing_ok=True)
        logger.warning("cannot write the device profile cache %s: %s", path, e.strerror)
