"""Measured networks: recovering regions and instances from noisy links, and making noisy twins of a network.

No two measured links are equal, so a measured network has no exact twins (``canonical``), and a search
that leans on twins (moving a whole region at once, caching a group's value by the regions of its
members) loses its footing. ``link_clusters`` recovers the structure: devices whose link rows are alike
— the same region, the same multi-GPU instance — fall into one cluster, by hierarchical clustering
(average linkage) of their rows of log latency and log bandwidth. ``snapped`` then replaces every link by
the average over its pair of clusters, a network whose clusters are exact twins, which the partition
search solves as fast and as well as the paper's tidy matrices; its plan is then improved on the links as
measured.

The distance between two devices is the mean absolute difference of their rows (log latency plus log
bandwidth, each device's own column filled with its cheapest link so that its place in a cluster still
shows). Noise of ±x % moves it by about the same amount for every pair, while a different region or
instance adds the difference of their links over whole blocks of columns. So the cut is placed relative
to the noise: at ``CUT_OVER_NOISE`` times the median distance of a device to its nearest other device
(twins, in a network with any structure). On exact matrices that distance is zero, and the clusters are
exactly the twin classes.

``perturbed`` makes the measured twin of a network (every link's latency and bandwidth scaled by its own
random factor in [1 − x, 1 + x], the same both ways; device order optionally shuffled): what tests and
benchmarks plan to see how the scheduler does on networks as agents measure them. Both keep the devices'
access capacities as they are.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import pdist

from p2ptrain.planning.cluster import Cluster

CUT_OVER_NOISE = 1.5
_LATENCY_FLOOR = 1e-3  # of the median positive latency: zero-delay links stay comparable in log space


def link_clusters(cluster: Cluster) -> np.ndarray:
    """Cluster labels 0, 1, … of the devices, numbered in order of each cluster's first device: the
    cluster's own ``groups`` where it has them (links estimated from a few measurements, ``estimated``)."""
    n = cluster.num_devices
    if cluster.groups is not None:
        numbers: dict[int, int] = {}
        return np.array([numbers.setdefault(int(g), len(numbers)) for g in cluster.groups], dtype=np.intp)
    if n < 3:
        return np.arange(n)
    lat, bw = cluster.latency_ms, cluster.bandwidth_gbps
    pos = lat[~np.eye(n, dtype=bool)]
    pos = pos[pos > 0]
    floor = _LATENCY_FLOOR * (float(np.median(pos)) if pos.size else 1.0)
    rows = []
    for m, sign in ((lat + floor, 1.0), (bw, -1.0)):  # both "cheaper is smaller": log delay, −log bandwidth
        f = sign * np.log(np.where(np.eye(n, dtype=bool), 1.0, m))
        off = f + np.diag(np.full(n, np.inf))
        np.fill_diagonal(f, off.min(axis=1))  # own column: the cheapest link
        rows.append(f)
    dist = pdist(np.hstack(rows), metric="cityblock") / n
    square_nn = np.full(n, np.inf)
    # nearest other device of each, from the condensed distances
    i, j = np.triu_indices(n, 1)
    np.minimum.at(square_nn, i, dist)
    np.minimum.at(square_nn, j, dist)
    noise = float(np.median(square_nn))
    tree = linkage(dist, method="average")
    labels = fcluster(tree, t=CUT_OVER_NOISE * noise + 1e-12, criterion="distance")
    first: dict[int, int] = {}
    for lab in labels:
        first.setdefault(int(lab), len(first))
    return np.array([first[int(lab)] for lab in labels], dtype=np.intp)


def snapped(cluster: Cluster, labels: np.ndarray) -> Cluster:
    """The network with every link replaced by its cluster pair's average: mean latency and the bandwidth
    of the mean transfer time (harmonic mean), so that α + c/β averages exactly."""
    n = cluster.num_devices
    k = int(labels.max()) + 1
    onehot = np.zeros((n, k))
    onehot[np.arange(n), labels] = 1.0
    off = ~np.eye(n, dtype=bool)
    counts = onehot.T @ off.astype(float) @ onehot  # ordered pairs of distinct devices per cluster pair
    inv_bw = np.where(off, 1.0 / np.where(off, cluster.bandwidth_gbps, 1.0), 0.0)
    lat = np.where(off, cluster.latency_ms, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_lat = (onehot.T @ lat @ onehot) / counts
        mean_inv_bw = (onehot.T @ inv_bw @ onehot) / counts
    latency = mean_lat[labels][:, labels]
    bandwidth = 1.0 / mean_inv_bw[labels][:, labels]
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, 0.0)
    return dataclasses.replace(cluster, latency_ms=latency, bandwidth_gbps=bandwidth)


def perturbed(cluster: Cluster, relative: float, rng: np.random.Generator, *, shuffle: bool = True) -> tuple[Cluster, np.ndarray]:
    """A measured twin of ``cluster`` and the device order used: device k of the result is ``order[k]``
    of ``cluster``. Each link's latency and bandwidth get independent factors uniform in
    [1 − relative, 1 + relative], the same in both directions."""
    if not 0 <= relative < 1:
        raise ValueError(f"a perturbation must be in [0, 1), got {relative!r}")
    n = cluster.num_devices

    def factors() -> np.ndarray:
        f = np.triu(rng.uniform(1 - relative, 1 + relative, size=(n, n)), 1)
        return f + f.T + np.eye(n)

    noisy = dataclasses.replace(cluster, latency_ms=cluster.latency_ms * factors(),
                                bandwidth_gbps=cluster.bandwidth_gbps * factors())  # access capacities kept
    order = rng.permutation(n) if shuffle else np.arange(n)
    return noisy.permuted(order), order
