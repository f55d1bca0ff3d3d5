"""``[verify]``: how a run checks its members' work (docs/verification.md). A run setting: every agent says it in
its settings line (``agent.leadership.settings.identity``), so peers that verify otherwise are not members of one
run and no leader can turn it off or down for its followers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.errors import ConfigError
from p2ptrain.verify.commit import DEFAULT_RATE
from p2ptrain.verify.sketch import FALSE_ALARM, MAX_ROWS, SKETCH_ROWS


@dataclass(frozen=True)
class VerifyConfig:
    enabled: bool = True  # the sum check (``verify.sum_check``) and the recompute check (``verify.recompute_check``), every step
    rate: float = DEFAULT_RATE  # micro-batches recomputed per member per step (``verify.recompute_check``)
    sketch_rows: int = SKETCH_ROWS  # rows k of the sum check's sketches
    false_alarm: float = FALSE_ALARM  # the probability an honest member fails one check, at most
    running: bool = True  # the sum check also over the running sums since the epoch began (``verify.sum_check``)
    # replicas that recompute each member's challenged micro-batches (at most the group's others): two, so that
    # two colluding members of a group of three or more do not verify each other alone (``verify.recompute_check``)
    verifiers: int = 2
    # a leader's wait for a finder's evidence of a failed recompute (``verify.evidence``), plus a second a MB; not
    # a run setting (the leader's own patience)
    evidence_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool) or not isinstance(self.running, bool):
            raise ConfigError("verify.enabled and verify.running are true or false")
        if not (isinstance(self.rate, int | float) and 0 < self.rate <= 1):
            raise ConfigError(f"verify.rate={self.rate!r} must lie in (0, 1]")
        if not (isinstance(self.sketch_rows, int) and 8 <= self.sketch_rows <= MAX_ROWS):
            raise ConfigError(f"verify.sketch_rows={self.sketch_rows!r} must lie in 8..{MAX_ROWS}")
        if not (isinstance(self.false_alarm, int | float) and 0 < self.false_alarm <= 2.0**-20):
            raise ConfigError(f"verify.false_alarm={self.false_alarm!r} must lie in (0, 2^-20]")
        if not (isinstance(self.verifiers, int) and not isinstance(self.verifiers, bool) and 1 <= self.verifiers <= 8):
            raise ConfigError(f"verify.verifiers={self.verifiers!r} must be an integer in 1..8")
        if not (isinstance(self.evidence_timeout_s, int | float) and 0 < self.evidence_timeout_s <= 3600):
            raise ConfigError(f"verify.evidence_timeout_s={self.evidence_timeout_s!r} must lie in (0, 3600]")

    def identity(self) -> str:
        """The setting as said in a settings line (``[a-z0-9_.]``, at most 24 characters): ``off``, or
        ``<rows>_<-log2 false_alarm>_<rate>_<running>``, e.g. ``64_40_0.125_1`` (the default), then ``_v<verifiers>``
        where that is not the default's."""
        if not self.enabled:
            return "off"
        bits = f"{-math.log2(self.false_alarm):.3f}".rstrip("0").rstrip(".")
        rate = f"{self.rate:.6f}".rstrip("0").rstrip(".")
        extra = "" if self.verifiers == VerifyConfig.verifiers else f"_v{self.verifiers}"
        return f"{self.sketch_rows}_{bits}_{rate}_{int(self.running)}{extra}"


def runs_sums(running: bool, codec: str) -> bool:
    """Whether the running sums are checked (``[verify] running``) under the gradient codec ``codec``: not under
    fp32, whose messages are exact. There an owner has no slack and no residual to carry, so the step's check
    bounds only float32 additions, and a bias repeated every step grows against a running tolerance as fast as
    that tolerance grows (each step adds its own additions' bound): the running sums would catch nothing the
    step's check misses, at twice its sketches."""
    return running and codec != "fp32"
