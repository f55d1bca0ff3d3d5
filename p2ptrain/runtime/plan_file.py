"""A plan file for the fixed-plan launcher: ``p2ptrain train --plan FILE [--cluster FILE | --scenario NAME]``.

The file is the plan JSON of docs/design.md (``p2ptrain plan --json`` writes it): ``stages``, ``replicas`` and
``pipelines[i][j]``, the device holding stage ``j`` of pipeline ``i``. Worker (stage j, replica i) plays
that device; with a cluster, its transport emulates the device's links (docs/design.md's link emulation).
An optional ``layers`` (a plan for mixed devices: stage j holds blocks [a, b)) is the split the stages are
built with; without it, the even split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.net.transport.emulation import EmulationConfig
from p2ptrain.planning.split import check_layers
from p2ptrain.runtime.worker import LinkMatrices


@dataclass(frozen=True)
class PlanFile:
    stages: int
    replicas: int
    pipelines: tuple[tuple[int, ...], ...]
    layers: tuple[tuple[int, int], ...] | None = None

    def device_of_role(self) -> dict[str, int]:
        return {f"{s}/{r}": self.pipelines[r][s] for r in range(self.replicas) for s in range(self.stages)}

    def links(self, latency_ms, bandwidth_gbps, emulation: EmulationConfig, uplink_gbps=None,
              downlink_gbps=None) -> LinkMatrices:
        """The emulated network of a cluster of exactly this plan's devices (and their access links)."""
        if len(latency_ms) != self.stages * self.replicas:
            raise ValueError(
                f"the cluster has {len(latency_ms)} devices but the plan places {self.stages * self.replicas}"
            )
        return LinkMatrices(
            latency_ms=tuple(tuple(float(x) for x in row) for row in latency_ms),
            bandwidth_gbps=tuple(tuple(float(x) for x in row) for row in bandwidth_gbps),
            device_of_role=self.device_of_role(),
            emulation=emulation,
            uplink_gbps=_capacities(uplink_gbps),
            downlink_gbps=_capacities(downlink_gbps),
        )


def _capacities(values) -> tuple[float | None, ...] | None:
    """Access capacities as plain data (None for no limit), from a cluster's vector or None."""
    if values is None:
        return None
    return tuple(float(v) if math.isfinite(float(v)) else None for v in values)


def load_plan_file(path: str | Path) -> PlanFile:
    """Read and check a plan file; a ValueError (one line) names what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"plan file {path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"plan file {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"plan file {path}: expected a JSON object")
    stages, replicas, pipelines = data.get("stages"), data.get("replicas"), data.get("pipelines")
    for name, value in (("stages", stages), ("replicas", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan file {path}: {name} must be a positive integer, got {value!r}")
    if not isinstance(pipelines, list) or len(pipelines) != replicas:
        raise ValueError(f"plan file {path}: pipelines must be a list of {replicas} pipelines")
    rows = []
    for i, row in enumerate(pipelines):
        if not isinstance(row, list) or len(row) != stages:
            raise ValueError(f"plan file {path}: pipeline {i} must list {stages} devices")
        if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < stages * replicas for d in row):
            raise ValueError(f"plan file {path}: pipeline {i} holds a device outside 0..{stages * replicas - 1}")
        rows.append(tuple(row))
    flat = [d for row in rows for d in row]
    if len(set(flat)) != len(flat):
        raise ValueError(f"plan file {path}: a device appears twice")
    layers = data.get("layers")
    if layers is not None:
        try:
            end = layers[-1][1] if isinstance(layers, list) and layers and isinstance(layers[-1], list) else -1
            layers = check_layers(layers, end if isinstance(end, int) else -1, stages)
        except (ValueError, IndexError) as e:
            raise ValueError(f"plan file {path}: {e}") from None
    return PlanFile(stages, replicas, tuple(rows), layers)
