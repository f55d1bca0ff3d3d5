"""The e2e benchmark's chart (matplotlib, the ``bench`` extra): predicted against measured step time for
every plan and network (left; the band is ±15 %), and the scheduled plan's speedups over Megatron's order
and over a random assignment, measured beside predicted, per network (right)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402

MARKERS = {"scheduled": "o", "megatron": "s", "random": "^", "communication_only": "D"}
TOLERANCE = 0.15


def draw(reports: list[dict[str, Any]], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    top = 0.0
    for k, report in enumerate(reports):
        for plan, row in report["plans"].items():
            top = max(top, row["measured_step_s"], row["predicted_step_s"])
            left.scatter(row["measured_step_s"], row["predicted_step_s"], marker=MARKERS.get(plan, "x"),
                         color=colours[k % len(colours)], label=f"{report['scenario']}, {plan}")
    top *= 1.1
    left.plot([0, top], [0, top], color="black", linewidth=0.8)
    left.fill_between([0, top], [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)], color="grey", alpha=0.15)
    left.set(xlim=(0, top), ylim=(0, top), xlabel="measured step time (emulated s)",
             ylabel="predicted step time (emulated s)", title="simulated objective vs measurement (±15 %)")
    left.legend(fontsize=7, ncol=2)

    names = [r["scenario"] for r in reports]
    series = [("over_megatron", "measured"), ("over_megatron", "predicted"), ("over_random", "measured"),
              ("over_random", "predicted")]
    width = 0.8 / len(series)
    for i, (base, kind) in enumerate(series):
        values = [r["speedups"].get(base, {}).get(kind, float("nan")) for r in reports]  # nan: not run
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(reports))]
        right.bar(xs, values, width, label=f"{base.replace('_', ' ')}, {kind}",
                  color=colours[(i // 2) % len(colours)], alpha=1.0 if kind == "measured" else 0.45)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(reports)), names)
    right.set(ylabel="speedup of the scheduled plan (×)", title="scheduled plan: measured and predicted speedups")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
