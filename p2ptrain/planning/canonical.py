"""A device order that does not depend on how the devices were listed, and the classes of twin devices.

The scheduler searches in this canonical order and maps its plan back, so shuffling a cluster's device
indices gives the same plan up to that shuffle (and so the same cost).

Twins: devices a and b are twins when swapping them changes nothing — equal links to every other device
(both ways), a symmetric link between them, equal attributes (speed, memory, access capacity). A region
or an instance of the paper's networks is a twin class. Swapping two twins is a symmetry of the problem,
so (1) the search never tries it, and (2) the order inside a twin class cannot matter. We detect twin classes that are cliques with one
uniform internal link (the case of regions and instances); anything subtler is left as singletons, which
is always safe.

Canonical order of the classes: colour refinement (1-dimensional Weisfeiler–Lehman) on the graph of
classes, whose node colour is (class size, attributes, internal link) and whose edge label is the link
between representatives. Colours are ranks of sorted signatures, so they do not depend on input order.
While a colour holds several classes, the first of them is individualised and refinement runs again —
exact when such classes are symmetric to each other, as in every structured network we know of (in a
generic measured network every class gets its own colour at once). After ``MAX_INDIVIDUALISATIONS``
the remaining ties are broken by input order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from p2ptrain.planning.cluster import Cluster

MAX_INDIVIDUALISATIONS = 64


@dataclass(frozen=True, eq=False)
class CanonicalOrder:
    """``order[k]`` is the input index of canonical device k; ``twin_class[k]`` its twin class (0, 1, …)."""

    order: np.ndarray
    twin_class: np.ndarray

    @property
    def inverse(self) -> np.ndarray:
        inv = np.empty_like(self.order)
        inv[self.order] = np.arange(len(self.order))
        return inv


def _capacity(cluster: Cluster, key: str) -> np.ndarray:
    """A device attribute: its access capacity (0 for none), so that devices behind other lines are not twins."""
    values = getattr(cluster, key)
    return np.zeros(cluster.num_devices) if values is None else np.where(np.isfinite(values), values, 0.0)


def canonical_order(cluster: Cluster) -> CanonicalOrder:
    features = _edge_features(cluster)
    n = cluster.num_devices
    attrs = np.column_stack([[d.tflops or 0.0 for d in cluster.devices], [d.memory_gb or 0.0 for d in cluster.devices],
                             *(_capacity(cluster, key) for key in ("uplink_gbps", "downlink_gbps"))])
    labels = _labels(features, n)
    colour = _refine(labels, _rank_rows(np.hstack([attrs, np.sort(labels, axis=1)])))
    classes = _twin_classes(features, labels, attrs, colour)
    reps = np.array([c[0] for c in classes])
    sizes = np.array([len(c) for c in classes])
    internal = np.array([features[c[0], c[1]] if len(c) > 1 else np.full(4, -1.0) for c in classes])
    q_labels = labels[np.ix_(reps, reps)]
    q_colour = _refine(q_labels, _rank_rows(np.column_stack([sizes, attrs[reps], internal, colour[reps]])))
    for _ in range(MAX_INDIVIDUALISATIONS):
        values, counts = np.unique(q_colour, return_counts=True)
        shared = values[counts > 1]
        if not len(shared):
            break
        first = int(np.flatnonzero(q_colour == shared[0])[0])
        seed = q_colour * 2
        seed[first] -= 1  # a colour of its own, still ordered before its former cellmates
        q_colour = _refine(q_labels, _rank_rows(seed[:, None]))
    class_rank = np.lexsort((np.arange(len(classes)), q_colour))
    order, twin = [], []
    for k, c in enumerate(class_rank):
        order.extend(classes[c])
        twin.extend([k] * len(classes[c]))
    return CanonicalOrder(np.array(order, dtype=np.intp), np.array(twin, dtype=np.intp))


def _edge_features(cluster: Cluster) -> np.ndarray:
    a, b = cluster.latency_ms, cluster.bandwidth_gbps
    f = np.stack([a, b, a.T, b.T], axis=-1)
    n = cluster.num_devices
    f[np.arange(n), np.arange(n)] = -1.0
    return f


def _labels(features: np.ndarray, n: int) -> np.ndarray:
    """Integer label per directed link; equal links get equal labels, the diagonal −1."""
    flat = features.reshape(n * n, -1)
    order = np.lexsort(flat.T[::-1])
    step = np.ones(len(flat), dtype=np.int64)
    step[1:] = (flat[order][1:] != flat[order][:-1]).any(axis=1)
    inv = np.empty(len(flat), dtype=np.int64)
    inv[order] = np.cumsum(step) - 1
    labels = inv.reshape(n, n).astype(np.int64)
    np.fill_diagonal(labels, -1)
    return labels


def _rank_rows(rows: np.ndarray) -> np.ndarray:
    _, inv = np.unique(rows, axis=0, return_inverse=True)
    return inv.ravel().astype(np.int64)


def _refine(labels: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """Colour refinement until stable: a node's new colour is its colour plus the multiset of (link, colour)."""
    n = len(colour)
    while True:
        k = int(colour.max()) + 1
        keys = labels * k + colour[None, :]
        np.fill_diagonal(keys, -1)
        new = _rank_rows(np.column_stack([colour, np.sort(keys, axis=1)])) if n > 1 else colour
        if len(np.unique(new)) == len(np.unique(colour)):
            return new
        colour = new


def _twin_classes(features: np.ndarray, labels: np.ndarray, attrs: np.ndarray, colour: np.ndarray) -> list[list[int]]:
    """Twin classes (each in input order). Twins always share a colour, so only cellmates are compared."""
    symmetric = (features[..., 0] == features[..., 2]) & (features[..., 1] == features[..., 3])
    classes: list[list[int]] = []
    for c in np.unique(colour):
        cell = np.flatnonzero(colour == c)
        block = labels[np.ix_(cell, cell)]
        same_attrs = (attrs[cell][:, None, :] == attrs[cell][None, :, :]).all(axis=2)
        pos = np.arange(len(cell))
        left = np.ones(len(cell), dtype=bool)
        for i in pos:
            if not left[i]:
                continue
            cand = pos[left]
            differ = block[cand] != block[i]
            # twins of i differ from it only at columns i and themselves (their links to each other)
            differ[:, i] = False
            differ[np.arange(len(cand)), cand] = False
            twins = cand[~differ.any(axis=1) & same_attrs[i, cand] & symmetric[cell[i], cell[cand]]]
            twins = np.union1d(twins, [i])
            left[twins] = False
            classes.append([int(x) for x in cell[twins]])
    classes.sort(key=lambda members: members[0])
    return classes
