"""The paper's five networks, built from ``data/scenarios.json``, at 64 devices or scaled to any N.

At N = 64 each network is exactly the paper's (device order as in NOTES.md, so Megatron's default rank
order reproduces the paper's figures). ``scenario(name, N)`` keeps each network's structure at other
sizes — devices are listed instance by instance or region by region, always in the order below:

- ``datacenter``: instances of g GPUs, g the largest divisor of N with g ≤ 8 and g ≤ N/2 (so there are
  always at least two instances): 64 → 8×8, 1024 → 128×8, 12 → 2×6, 8 → 2×4. 100 Gbit/s inside an
  instance, 3.125 across, no delay.
- ``spot``: half the devices in 4-GPU instances, the other half single-GPU instances: ⌊N/8⌋ instances of
  4 GPUs first, then N − 4⌊N/8⌋ singles (64 → 8×4 + 32, 8 → 1×4 + 4, 12 → 1×4 + 8). Below 8 devices, one
  instance of ⌊N/2⌋ GPUs and the rest single. 100 Gbit/s inside an instance, 1.25 elsewhere, no delay.
- ``multi_dc``: ⌈N/2⌉ devices in Ohio, then ⌊N/2⌋ in Virginia. 1 ms / 5 Gbit/s inside a region,
  11 ms / 1.12 across.
- ``regional``: Virginia, Oregon, California, Ohio, N shared out as evenly as possible (earlier regions
  take the remainder; with N < 4 only the first N regions). 5 ms / 2 Gbit/s inside a region; across, the
  paper's regional configuration (Virginia–Oregon 1.15 Gbit/s there, not the 0.79 of the world table).
- ``worldwide``: Oregon, Virginia, Ohio, Tokyo, Seoul, London, Frankfurt, Ireland, shared out the same way
  (8 → one device a region, 1024 → 128 a region). 5 ms / 2 Gbit/s inside; across, the inter-region table.

Not the paper's (``MIXED_SCENARIOS``; the paper's five are ``SCENARIOS``):

- ``volunteers``: the ``worldwide`` network with a volunteer's mix of cards instead of 64 V100s: device k
  (listed region by region) is card ``VOLUNTEER_CARDS[k % 8]``, so 8 devices give one card a region and
  64 give every region one of each. Each card's peak dense fp16/bf16 tensor TFLOP/s (fp32 accumulate) and
  memory, from the vendors' data sheets (see ``VOLUNTEER_CARDS``).

Not a datacenter at all (``HOME_SCENARIOS``, reachable by name but not among the networks above):

- ``homes``: one device per home (``homes``): every pair at 100 Mbit/s, a latency of 20–150 ms, and each
  home's 100 Mbit/s uplink and downlink shared by all its flows (the cluster's access links).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from p2ptrain.planning.cluster import Cluster, Device

SCENARIOS = ("datacenter", "spot", "multi_dc", "regional", "worldwide")  # the paper's networks
MIXED_SCENARIOS = ("volunteers",)  # mixed GPUs on the paper's world-wide links
ALL_SCENARIOS = SCENARIOS + MIXED_SCENARIOS
HOME_SCENARIOS = ("homes",)  # one device per home, each behind its access link
NAMED_SCENARIOS = ALL_SCENARIOS + HOME_SCENARIOS  # every name ``scenario`` knows

# (card, peak dense fp16/bf16 tensor TFLOP/s with fp32 accumulate, memory GB), from the data sheets:
# NVIDIA A100 Tensor Core GPU data sheet (SXM 80 GB: 312 TFLOP/s bf16); NVIDIA Ada GPU architecture
# whitepaper, appendix (GeForce RTX 4090: 165.2 TFLOP/s fp16 with fp32 accumulate, 24 GB); NVIDIA Ampere
# GA102 GPU architecture whitepaper (GeForce RTX 3090: 71 TFLOP/s fp16 with fp16 accumulate, 35.6 with
# fp32; 24 GB); NVIDIA T4 data sheet (65 TFLOP/s mixed precision, 16 GB); NVIDIA V100 data sheet (SXM2
# 32 GB: 125 TFLOP/s); NVIDIA A10 data sheet (125 TFLOP/s fp16 tensor, 24 GB).
VOLUNTEER_CARDS: tuple[tuple[str, float, float], ...] = (
    ("A100-80GB", 312.0, 80.0),
    ("RTX4090", 165.2, 24.0),
    ("RTX3090", 35.6, 24.0),
    ("T4", 65.0, 16.0),
    ("V100-32GB", 125.0, 32.0),
    ("RTX3090", 35.6, 24.0),
    ("A10", 125.0, 24.0),
    ("T4", 65.0, 16.0),
)
HOME_LATENCY_MS = (20.0, 150.0)  # ``homes``: a pair's latency, uniform in this range


def homes(num_devices: int, bandwidth_gbps: float = 0.1, seed: int = 0, access: bool = True) -> Cluster:
    """``num_devices`` homes, one device each: every pair at ``bandwidth_gbps`` (100 Mbit/s by default) and a
    latency drawn uniformly from 20–150 ms (symmetric; ``seed`` draws it). With ``access`` each home's uplink
    and downlink are ``bandwidth_gbps`` too, shared by its flows (``Cluster.uplink_gbps``/``downlink_gbps``):
    a home sending to several others at once sends to each at a share of its uplink. Without it each pair
    is a path of its own (optimistic: a home's flows then add up to more than its line)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 2:
        raise ValueError(f"homes: the number of devices must be an integer of at least 2, got {num_devices!r}")
    if not bandwidth_gbps > 0:
        raise ValueError(f"homes: bandwidth must be positive, got {bandwidth_gbps!r}")
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.uniform(*HOME_LATENCY_MS, size=(num_devices, num_devices)), 1)
    latency = upper + upper.T
    bandwidth = np.full((num_devices, num_devices), float(bandwidth_gbps))
    devices = [Device(name=f"home-{k}", region=f"home-{k}") for k in range(num_devices)]
    line = np.full(num_devices, float(bandwidth_gbps)) if access else None
    return _finish(devices, latency, bandwidth, line, line)


PAPER_DEVICES = 64
PAPER_STAGES = 8

# The paper's figures for its 64-device networks (NOTES.md): cost in seconds of Megatron's default rank
# order and of the layout its scheduler (GCMA) found, and GCMA's run time on one core.
PAPER_REFERENCE: dict[str, dict[str, float]] = {
    "datacenter": {"megatron_s": 16.981, "gcma_s": 3.440, "gcma_search_s": 400},
    "spot": {"megatron_s": 49.504, "gcma_s": 49.504, "gcma_search_s": 557},
    "multi_dc": {"megatron_s": 17.648, "gcma_s": 16.087, "gcma_search_s": 391},
    "regional": {"megatron_s": 39.983, "gcma_s": 34.802, "gcma_search_s": 390},
    "worldwide": {"megatron_s": 75.294, "gcma_s": 49.218, "gcma_search_s": 304},
}

_REGIONAL = ("Virginia", "Oregon", "California", "Ohio")
_WORLDWIDE = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland")


@cache
def scenario_data() -> dict[str, Any]:
    """The packaged copy of the paper's network figures (``p2ptrain/planning/data/scenarios.json``)."""
    return json.loads(resources.files("p2ptrain.planning").joinpath("data/scenarios.json").read_text())


def scenario(name: str, num_devices: int = PAPER_DEVICES) -> Cluster:
    """The network ``name`` with ``num_devices`` devices (see the module docstring for scaling): one of the
    paper's, ``volunteers`` or ``homes`` (with its defaults: 100 Mbit/s lines, seed 0)."""
    if name not in NAMED_SCENARIOS:
        raise ValueError(f"unknown scenario {name!r} (choose from {', '.join(NAMED_SCENARIOS)})")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"scenario: the number of devices must be a positive integer, got {num_devices!r}")
    if name == "homes":
        return homes(num_devices)
    if name == "volunteers":
        return _volunteers(scenario("worldwide", num_devices))
    spec = scenario_data()["scenarios"][name]
    if name in ("datacenter", "spot"):
        return _instances(name, spec, _instance_sizes(name, num_devices))
    if name == "multi_dc":
        regions = ("Ohio", "Virginia")
    else:
        regions = _REGIONAL if name == "regional" else _WORLDWIDE
    links = _region_links(spec)
    counts = _share(num_devices, len(regions))
    return _regions(regions, counts, spec["intra_region"], links)


def _volunteers(world: Cluster) -> Cluster:
    devices = []
    for k, d in enumerate(world.devices):
        card, tflops, memory_gb = VOLUNTEER_CARDS[k % len(VOLUNTEER_CARDS)]
        devices.append(Device(name=f"{d.name}-{card}", region=d.region, tflops=tflops, memory_gb=memory_gb))
    return dataclasses.replace(world, devices=tuple(devices))


def _instance_sizes(name: str, n: int) -> list[int]:
    if name == "datacenter":
        g = max(d for d in range(1, 9) if n % d == 0 and (d <= n // 2 or n == 1))
        return [g] * (n // g)
    k = n // 8
    if k:
        return [4] * k + [1] * (n - 4 * k)
    return ([n // 2] if n >= 2 else []) + [1] * (n - n // 2 if n >= 2 else n)


def _share(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _instances(name: str, spec: dict[str, Any], sizes: list[int]) -> Cluster:
    devices, owner = [], []
    for k, size in enumerate(sizes):
        for j in range(size):
            label = f"i{k}-g{j}" if size > 1 else f"s{k - sum(1 for s in sizes if s > 1)}"
            devices.append(Device(name=f"{name}-{label}", region=name))
            owner.append(k)
    owner_arr = np.array(owner)
    same = owner_arr[:, None] == owner_arr[None, :]
    inside, across = spec["intra_instance"], spec["inter_instance"]
    latency = np.where(same, inside["latency_ms"], across["latency_ms"]).astype(float)
    bandwidth = np.where(same, inside["bandwidth_gbps"], across["bandwidth_gbps"]).astype(float)
    return _finish(devices, latency, bandwidth)


def _region_links(spec: dict[str, Any]) -> dict[frozenset[str], tuple[float, float]]:
    links = {
        frozenset((x["a"], x["b"])): (float(x["latency_ms"]), float(x["bandwidth_gbps"]))
        for x in scenario_data()["inter_region_links"]
    }
    for x in spec.get("extra_links", []):  # the regional case's own figures take precedence
        links[frozenset((x["a"], x["b"]))] = (float(x["latency_ms"]), float(x["bandwidth_gbps"]))
    return links


def _regions(
    regions: tuple[str, ...], counts: list[int], intra: dict[str, float], links: dict[frozenset[str], tuple[float, float]]
) -> Cluster:
    devices = [Device(name=f"{r}-{k}", region=r) for r, c in zip(regions, counts, strict=False) for k in range(c)]
    names = [d.region for d in devices]
    n = len(devices)
    latency, bandwidth = np.empty((n, n)), np.empty((n, n))
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if a == b:
                latency[i, j], bandwidth[i, j] = intra["latency_ms"], intra["bandwidth_gbps"]
            else:
                latency[i, j], bandwidth[i, j] = links[frozenset((a, b))]
    return _finish(devices, latency, bandwidth)


def _finish(devices: list[Device], latency: np.ndarray, bandwidth: np.ndarray, uplink: np.ndarray | None = None,
            downlink: np.ndarray | None = None) -> Cluster:
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, 0.0)  # the diagonal is ignored
    return Cluster(tuple(devices), latency, bandwidth, uplink, downlink)
