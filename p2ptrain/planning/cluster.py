"""A cluster: the devices and the one-way delay (α) and bandwidth (β) between every pair.

The file format (docs/design.md, "Cluster file")::

    {"devices": [{"name": "d0", "region": "Oregon", "tflops": 112.0, "memory_gb": 16.0}, ...],
     "latency_ms": [[0, 67.0, ...], ...],
     "bandwidth_gbps": [[100.0, 0.79, ...], ...],
     "uplink_gbps": [0.1, null, ...], "downlink_gbps": [0.1, null, ...]}

``latency_ms`` is the one-way delay α in milliseconds, ``bandwidth_gbps`` the bandwidth β in Gbit/s; both
are N×N with N the number of devices. The diagonal is ignored (a device does not talk to itself).
Matrices need not be symmetric: the cost model charges a link both ways (forward and backward), so an
asymmetric measurement is used as it was measured. Everything wrong with a file is a one-line ValueError.

``uplink_gbps`` and ``downlink_gbps`` (optional, N entries each) are a device's access link: the capacity
U_p every message it sends shares, and D_p every message it receives shares, besides each pair's own path
β (a home's router: one queue for all its flows). ``null`` (or the key left out) is no such limit. The
``simulated`` objective prices them (its module docstring has the model); in memory an absent limit is
``inf``.
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
_ACCESS_KEYS = ("uplink_gbps", "downlink_gbps")


@dataclass(frozen=True)
class Device:
    """One device: a name unique in its cluster, and what is known of it (region, speed, memory)."""

    name: str
    region: str | None = None
    tflops: float | None = None
    memory_gb: float | None = None


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and their links. The matrices are read-only float64 arrays, indexed like ``devices``; the
    access capacities are read-only float64 vectors (``inf``: no limit) or None (no device has one)."""

    devices: tuple[Device, ...]
    latency_ms: np.ndarray = field(repr=False)
    bandwidth_gbps: np.ndarray = field(repr=False)
    uplink_gbps: np.ndarray | None = field(default=None, repr=False)
    downlink_gbps: np.ndarray | None = field(default=None, repr=False)
    # Groups of devices alike to all the others (regions, instances), where something knew them better than
    # the matrices show (``estimated``: links estimated from a few measured ones are alike by construction);
    # None: recovered from the matrices (``measured.link_clusters``). In memory only, not in the file.
    groups: np.ndarray | None = field(default=None, repr=False)
    # N×N, True where a link was estimated rather than measured (``estimated``); None: every link is as given
    estimated: np.ndarray | None = field(default=None, repr=False)

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
        for key in _ACCESS_KEYS:
            object.__setattr__(self, key, _capacities(getattr(self, key), key, n))
        if self.groups is not None:
            groups = np.asarray(self.groups, dtype=np.intp)
            if groups.shape != (n,) or (groups < 0).any():
                raise ValueError(f"cluster: groups must be {n} labels >= 0")
            groups.setflags(write=False)
            object.__setattr__(self, "groups", groups)
        if self.estimated is not None:
            estimated = np.asarray(self.estimated, dtype=bool)
            if estimated.shape != (n, n):
                raise ValueError(f"cluster: estimated must be {n}x{n}")
            estimated.setflags(write=False)
            object.__setattr__(self, "estimated", estimated)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def has_access_links(self) -> bool:
        """Whether some device has an uplink or downlink capacity (the ``simulated`` objective prices it)."""
        return self.uplink_gbps is not None or self.downlink_gbps is not None

    def to_dict(self) -> dict[str, Any]:
        """The cluster in the file format (optional device fields left out when unknown)."""
        devices = [{k: getattr(d, k) for k in _DEVICE_KEYS if getattr(d, k) is not None} for d in self.devices]
        doc: dict[str, Any] = {
            "devices": devices,
            "latency_ms": self.latency_ms.tolist(),
            "bandwidth_gbps": self.bandwidth_gbps.tolist(),
        }
        for key in _ACCESS_KEYS:
            values = getattr(self, key)
            if values is not None:
                doc[key] = [float(v) if math.isfinite(v) else None for v in values]
        return doc

    def permuted(self, order: np.ndarray | list[int]) -> Cluster:
        """The same cluster with device i of the result being device ``order[i]`` of this one."""
        idx = np.asarray(order, dtype=np.intp)
        return Cluster(
            devices=tuple(self.devices[i] for i in idx),
            latency_ms=self.latency_ms[np.ix_(idx, idx)],
            bandwidth_gbps=self.bandwidth_gbps[np.ix_(idx, idx)],
            uplink_gbps=None if self.uplink_gbps is None else self.uplink_gbps[idx],
            downlink_gbps=None if self.downlink_gbps is None else self.downlink_gbps[idx],
            groups=None if self.groups is None else self.groups[idx],
            estimated=None if self.estimated is None else self.estimated[np.ix_(idx, idx)],
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


def _capacities(value: Any, key: str, n: int) -> np.ndarray | None:
    """An access capacity vector: N positive finite numbers or None (no limit); None when none is limited."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        raw = [None if not math.isfinite(v) and v > 0 else v for v in value.astype(float).tolist()]
    elif isinstance(value, list | tuple):
        raw = list(value)
    else:
        raise ValueError(f"cluster: {key} must be a list of {n} numbers (Gbit/s) or nulls")
    if len(raw) != n:
        raise ValueError(f"cluster: {key} has {len(raw)} entries but there are {n} devices")
    out = np.full(n, np.inf)
    for i, v in enumerate(raw):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"cluster: {key}[{i}] must be a positive finite number (Gbit/s) or null, got {v!r}")
        out[i] = float(v)
    if np.isinf(out).all():
        return None
    out.setflags(write=False)
    return out


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
    unknown = sorted(set(data) - set(_CLUSTER_KEYS) - set(_ACCESS_KEYS))
    if unknown:
        raise ValueError(f"cluster: unknown key {unknown[0]!r} (known: {', '.join(_CLUSTER_KEYS + _ACCESS_KEYS)})")
    missing = [k for k in _CLUSTER_KEYS if k not in data]
    if missing:
        raise ValueError(f"cluster: missing {missing[0]!r}")
    raw = data["devices"]
    if not isinstance(raw, list):
        raise ValueError("cluster: devices must be a list")
    devices = tuple(_device(d, i) for i, d in enumerate(raw))
    return Cluster(devices, data["latency_ms"], data["bandwidth_gbps"], data.get("uplink_gbps"),
                   data.get("downlink_gbps"))


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
