"""A cluster: the devices and the one-way delay (α) and bandwidth (β) between every pair.

The file format (DESIGN.md, "Cluster file")::

    {"devices": [{"name": "d0", "region": "Oregon", "tflops": 112.0, "memory_gb": 16.0}, ...],
     "latency_ms": [[0, 67.0, ...], ...],
     "bandwidth_gbps": [[100.0, 0.79, ...], ...]}

``latency_ms`` is the one-way delay α in milliseconds, ``bandwidth_gbps`` the bandwidth β in Gbit/s; both
are N×N with N the number of devices. The diagonal is ignored (a device does not talk to itself).
Matrices need not be symmetric: the cost model charges a link both ways (forward and backward), so an
asymmetric measurement is used as it was measured. Everything wrong with a file is a one-line ValueError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_DEVICE_KEYS = ("name", "region", "tflops", "memory_gb")
_CLUSTER_KEYS = ("devices", "latency_ms", "bandwidth_gbps")


@dataclass(frozen=True)
class Device:
    """One device: a name unique in its cluster, and what is known of it (region, speed, memory)."""

    name: str
    region: str | None = None
    tflops: float | None = None
    memory_gb: float | None = None


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and their links. The matrices are read-only float64 arrays, indexed like ``devices``."""

    devices: tuple[Device, ...]
    latency_ms: np.ndarray = field(repr=False)
    bandwidth_gbps: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n == 0:
            raise ValueError("cluster: no devices")
        names = [d.name for d in self.devices]
        if len(set(names)) != n:
            dup = next(x for x in names if names.count(x) > 1)
            raise ValueError(f"cluster: device name {dup!r} appears twice")
        for key in ("latency_ms", "bandwidth_gbps"):
            m = _matrix(getattr(self, key), key, n)
            object.__setattr__(self, key, m)
        off = ~np.eye(n, dtype=bool)
        _check_values(self.latency_ms, off, "latency_ms", allow_zero=True)
        _check_values(self.bandwidth_gbps, off, "bandwidth_gbps", allow_zero=False)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict[str, Any]:
        """The cluster in the file format (optional device fields left out when unknown)."""
        devices = [{k: getattr(d, k) for k in _DEVICE_KEYS if getattr(d, k) is not None} for d in self.devices]
        return {
            "devices": devices,
            "latency_ms": self.latency_ms.tolist(),
            "bandwidth_gbps": self.bandwidth_gbps.tolist(),
        }

    def permuted(self, order: np.ndarray | list[int]) -> Cluster:
        """The same cluster with device i of the result being device ``order[i]`` of this one."""
        idx = np.asarray(order, dtype=np.intp)
        return Cluster(
            devices=tuple(self.devices[i] for i in idx),
            latency_ms=self.latency_ms[np.ix_(idx, idx)],
            bandwidth_gbps=self.bandwidth_gbps[np.ix_(idx, idx)],
        )


def _matrix(value: Any, key: str, n: int) -> np.ndarray:
    try:
        raw = np.array(value)
    except (TypeError, ValueError):  # ragged rows
        raw = None
    if raw is None or (raw.size and raw.dtype.kind not in "iuf"):
        raise ValueError(f"cluster: {key} must be an N×N matrix of numbers")
    m = raw.astype(np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"cluster: {key} is not square (shape {'×'.join(map(str, m.shape)) or 'scalar'})")
    if m.shape[0] != n:
        raise ValueError(f"cluster: {key} is {m.shape[0]}×{m.shape[0]} but there are {n} devices")
    m.setflags(write=False)
    return m


def _check_values(m: np.ndarray, off: np.ndarray, key: str, *, allow_zero: bool) -> None:
    vals = m[off]
    bad = ~np.isfinite(vals)
    if bad.any():
        i, j = np.argwhere(~np.isfinite(m) & off)[0]
        raise ValueError(f"cluster: {key}[{i}][{j}] is {m[i, j]} (must be a finite number)")
    if (vals < 0).any() or (not allow_zero and (vals == 0).any()):
        i, j = np.argwhere(((m < 0) if allow_zero else (m <= 0)) & off)[0]
        what = "non-negative" if allow_zero else "positive"
        raise ValueError(f"cluster: {key}[{i}][{j}] is {m[i, j]:g} (must be {what})")


def cluster_from_dict(data: Any) -> Cluster:
    """Build a cluster from the file format; a one-line ValueError names the first problem found."""
    if not isinstance(data, dict):
        raise ValueError(f"cluster: expected a JSON object with {', '.join(_CLUSTER_KEYS)}")
    unknown = sorted(set(data) - set(_CLUSTER_KEYS))
    if unknown:
        raise ValueError(f"cluster: unknown key {unknown[0]!r} (known: {', '.join(_CLUSTER_KEYS)})")
    missing = [k for k in _CLUSTER_KEYS if k not in data]
    if missing:
        raise ValueError(f"cluster: missing {missing[0]!r}")
    raw = data["devices"]
    if not isinstance(raw, list):
        raise ValueError("cluster: devices must be a list")
    devices = tuple(_device(d, i) for i, d in enumerate(raw))
    return Cluster(devices, data["latency_ms"], data["bandwidth_gbps"])


def _device(d: Any, i: int) -> Device:
    if not isinstance(d, dict):
        raise ValueError(f"cluster: devices[{i}] must be an object")
    unknown = sorted(set(d) - set(_DEVICE_KEYS))
    if unknown:
        raise ValueError(f"cluster: devices[{i}] has unknown key {unknown[0]!r} (known: {', '.join(_DEVICE_KEYS)})")
    name = d.get("name", f"d{i}")
    region = d.get("region")
    if not isinstance(name, str) or not name:
        raise ValueError(f"cluster: devices[{i}].name must be a non-empty string")
    if region is not None and not isinstance(region, str):
        raise ValueError(f"cluster: devices[{i}].region must be a string")
    numbers = {}
    for key in ("tflops", "memory_gb"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0):
            raise ValueError(f"cluster: devices[{i}].{key} must be a positive number, got {v!r}")
        numbers[key] = None if v is None else float(v)
    return Device(name=name, region=region, **numbers)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ValueError(f"cluster file {str(p)!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"cluster file {str(p)!r} cannot be read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"cluster file {str(p)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    try:
        return cluster_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
