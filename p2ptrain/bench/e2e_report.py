"""The tables and files of ``p2ptrain bench e2e`` reports (``bench.e2e.run_e2e``): the networks' table, the
settings' table, and the JSON, CSV and chart written beside them."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PLANS = ("scheduled", "communication_only", "megatron", "random")  # in the tables' order


def format_reports(reports: list[dict[str, Any]]) -> str:
    """The table of one or more networks' reports."""
    head = (f"{'network':<11} {'scale':>7} {'plan':<18} {'measured s':>10} {'predicted s':>11} {'error':>7} "
            f"{'paper s':>8} {'dtfm s':>7}  {'speedup: measured':>17} {'predicted':>9} {'dtfm':>6}")
    lines = [head, "-" * len(head)]
    for r in reports:
        for k, name in enumerate(p for p in PLANS if p in r["plans"]):
            p = r["plans"][name]
            ratio = "" if name == "scheduled" else _ratio_cells(r["speedups"][f"over_{name}"])
            scale = f"{r['time_scale']:7.3g}" if k == 0 else " " * 7
            net = r["scenario"] if k == 0 else ""
            lines.append(f"{net:<11} {scale} {name:<18} {p['measured_step_s']:10.3f} {p['predicted_step_s']:11.3f} "
                         f"{100 * p['error']:+6.1f}% {p['predicted_paper_s']:8.2f} {p['dtfm_step_s']:7.3f}  "
                         f"{ratio}".rstrip())
    first = reports[0]
    lines.append(
        f"{first['agents']} agents, {first['stages']} stages × {first['replicas']} replicas, {first['model']}, "
        f"batch {first['global_batch_size']} in {first['micro_batches']} micro-batches, {first['steps']} steps "
        f"(steps 2…{first['steps']}: the median of two consecutive steps' means), random assignment seed "
        f"{first['seed']}; size factor {first['size_factor']:.4g}; compute scale {first.get('compute_scale', 1):g} "
        f"(every device that many times slower than one core here, the time scale alike); seconds are emulated "
        f"(the network's times the scale) but 'paper s', the prediction in the network's seconds; dtfm: the "
        f"paper's cost of the same plan; speedup = baseline / scheduled"
    )
    return "\n".join(lines)


def format_settings(report: dict[str, Any]) -> str:
    """The table of a report's settings (``--settings``): each beside the first."""
    rows = report.get("settings") or {}
    if len(rows) < 2:
        return ""
    names = list(rows)
    base = rows[names[0]]
    head = (f"{'setting':<22} {'measured s':>10} {'predicted s':>11} {'error':>7} {'shown s':>8} {'error':>7} "
            f"{'speedup: measured':>17} {'predicted':>9} {'loss':>7}  plan")
    lines = [head, "-" * len(head)]
    for name in names:
        r = rows[name]
        same = "same" if r["pipelines"] == base["pipelines"] and r.get("layers") == base.get("layers") else "other"
        shown = (f"{r['repriced_step_s']:8.3f} {100 * r['repriced_error']:+6.1f}%" if r.get("repriced_step_s")
                 else f"{'-':>8} {'-':>7}")
        lines.append(f"{name:<22} {r['measured_step_s']:10.3f} {r['predicted_step_s']:11.3f} {100 * r['error']:+6.1f}% "
                     f"{shown} {base['measured_step_s'] / r['measured_step_s']:16.2f}× "
                     f"{base['predicted_step_s'] / r['predicted_step_s']:8.2f}× {r['loss_last']:7.4f}  {same}")
    lines.append(f"{report['scenario']}: the {report.get('settings_plan', 'scheduled')} plan per setting; predicted: the leader's, from the agents' "
                 f"calibration; shown: the same plan priced with the compute the trainers showed while training; "
                 f"speedup = the first setting's step time over this one's; loss after step {report['steps']}; "
                 f"plan: the same as the first setting's or another")
    return "\n".join(lines)


def _ratio_cells(s: dict[str, float]) -> str:
    return f"{s['measured']:16.2f}× {s['predicted']:8.2f}× {s['dtfm']:5.2f}×"


def write_results(reports: list[dict[str, Any]], out_dir: Path, stem: str) -> list[Path]:
    """``stem``.json (the list of reports), ``stem``.csv (a row per network and plan) and ``stem``.png in
    ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.csv"]
    paths[0].write_text(json.dumps(reports, indent=1) + "\n")
    with paths[1].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["network", "plan", "measured_step_s", "predicted_step_s", "error", "dtfm_step_s",
                         "predicted_paper_s", "time_scale", "size_factor"])
        for r in reports:
            for name in r["plans"]:
                p = r["plans"][name]
                writer.writerow([r["scenario"], name, f"{p['measured_step_s']:.4f}", f"{p['predicted_step_s']:.4f}",
                                 f"{p['error']:.4f}", f"{p['dtfm_step_s']:.4f}", f"{p['predicted_paper_s']:.4f}",
                                 f"{r['time_scale']:.6g}", f"{r['size_factor']:.6g}"])
    try:
        from p2ptrain.bench.e2e_chart import draw
    except ModuleNotFoundError as e:  # matplotlib is in the "bench" extra
        logger.warning("no chart: %s (pip install 'p2ptrain[bench]')", e)
        return paths
    paths.append(draw(reports, out_dir / f"{stem}.png"))
    return paths
