"""Who holds what in one epoch: the plan's table of peers, and each peer's neighbours and group.

``pipelines[i][j]`` is the peer holding stage ``j`` of pipeline ``i`` (pipeline ``i`` carries data shard
``i``); column ``j`` is stage ``j``'s data-parallel group, ordered by pipeline index. The pipeline index is
also the replica index: it decides which shard of every global batch a peer trains on, and the order in
which a group adds its gradients, so every replica computes bit-identical sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """One peer's place in the plan."""

    stage: int
    replica: int
    num_stages: int
    num_replicas: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class Topology:
    pipelines: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not self.pipelines or not self.pipelines[0]:
            raise ValueError("a topology needs at least one pipeline of at least one stage")
        if any(len(row) != len(self.pipelines[0]) for row in self.pipelines):
            raise ValueError("every pipeline of a topology must have the same number of stages")
        flat = [peer for row in self.pipelines for peer in row]
        if len(set(flat)) != len(flat):
            raise ValueError("a peer appears twice in the topology")

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[str]]) -> Topology:
        return cls(tuple(tuple(row) for row in rows))

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0])

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(peer for row in self.pipelines for peer in row)

    def role_of(self, peer: str) -> Role:
        for replica, row in enumerate(self.pipelines):
            for stage, holder in enumerate(row):
                if holder == peer:
                    return Role(stage, replica, self.num_stages, self.num_replicas)
        raise KeyError(f"peer {peer} has no role in this plan")

    def holder(self, stage: int, replica: int) -> str:
        return self.pipelines[replica][stage]

    def prev_peer(self, role: Role) -> str | None:
        return None if role.is_first else self.pipelines[role.replica][role.stage - 1]

    def next_peer(self, role: Role) -> str | None:
        return None if role.is_last else self.pipelines[role.replica][role.stage + 1]

    def group(self, stage: int) -> tuple[str, ...]:
        """Stage ``stage``'s data-parallel group, in replica order."""
        return tuple(row[stage] for row in self.pipelines)

    def neighbours(self, role: Role) -> set[str]:
        """The peers ``role`` exchanges tensors with: its pipeline neighbours and its replica group."""
        peers = set(self.group(role.stage))
        peers.update(p for p in (self.prev_peer(role), self.next_peer(role)) if p is not None)
        return peers - {self.holder(role.stage, role.replica)}
