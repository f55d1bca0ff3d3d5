"""Prometheus metrics of a run (``/metrics``), for organisers who already run Prometheus and Grafana.

A custom collector over the monitor's view: every scrape reads the view's state as it is then, so there
are no gauges to keep in step with it, and the registry is the monitor's own (never the process-global
one). Labels are the run ID and peer IDs only: both are validated identifiers, never peer-chosen free text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LIVENESS = ("training", "spare", "waiting", "halted", "silent", "left", "unknown")


class RunCollector:
    """Yields the run's metrics from ``state()`` (a ``RunView.state()`` document) and ``errors()``, the
    monitor's failed DHT polls."""

    def __init__(self, state: Callable[[], dict[str, Any]], errors: Callable[[], int]):
        self._state, self._errors = state, errors

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        run, summary = state["run"], state["summary"]
        peers = GaugeMetricFamily("p2ptrain_peers", "Peers seen by the monitor, by liveness", labels=["run", "liveness"])
        counts = Counter(p["liveness"] for p in state["peers"])
        for liveness in LIVENESS:
            peers.add_metric([run, liveness], counts.get(liveness, 0))
        yield peers
        gauges = {
            "epoch": ("p2ptrain_epoch", "Epoch of the plan the run follows"),
            "step": ("p2ptrain_step", "Highest step a heartbeat reported"),
            "loss": ("p2ptrain_loss", "Training loss of the latest step seen"),
            "step_time_s": ("p2ptrain_step_seconds", "Median measured step time of the latest steps"),
            "predicted_step_s": ("p2ptrain_predicted_step_seconds", "The plan's predicted step time"),
            "tokens_per_s": ("p2ptrain_tokens_per_second", "Training throughput (needs the tokens per step)"),
            "sync_every": ("p2ptrain_sync_every_steps", "Steps between data-parallel syncs (DiLoCo's H)"),
            "round": ("p2ptrain_round", "DiLoCo round in progress (the highest step seen // H)"),
            "sent_bytes_per_step": ("p2ptrain_sent_bytes_per_step", "Bytes the trainers sent in their last step"),
            "utilisation": ("p2ptrain_compute_utilisation_ratio", "Mean share of their step trainers computed"),
            "mfu": ("p2ptrain_mfu_ratio", "Model FLOPs utilisation, the mean of what the trainers saw"),
        }
        for key, (name, help_) in gauges.items():
            if summary.get(key) is not None:
                gauge = GaugeMetricFamily(name, help_, labels=["run"])
                gauge.add_metric([run], summary[key])
                yield gauge
        for key, name, help_ in (("replans", "p2ptrain_replans", "Re-plans seen (plan epochs after the first)"),
                                 ("joins", "p2ptrain_joins", "Peers that joined while the monitor watched"),
                                 ("leaves", "p2ptrain_leaves", "Peers whose records expired")):
            counter = CounterMetricFamily(name, help_, labels=["run"])
            counter.add_metric([run], summary[key])
            yield counter
        step = GaugeMetricFamily("p2ptrain_peer_step", "Step of each peer's latest heartbeat", labels=["run", "peer"])
        age = GaugeMetricFamily("p2ptrain_peer_heartbeat_age_seconds", "Seconds since each peer's heartbeat moved",
                                labels=["run", "peer"])
        sent = GaugeMetricFamily("p2ptrain_peer_sent_bytes_per_step", "Bytes each peer sent in its latest step",
                                 labels=["run", "peer"])
        used = GaugeMetricFamily("p2ptrain_peer_compute_utilisation_ratio",
                                 "Share of its latest step each peer computed", labels=["run", "peer"])
        mfu = GaugeMetricFamily("p2ptrain_peer_mfu_ratio", "The run's model FLOPs utilisation as each peer saw its "
                                "latest step", labels=["run", "peer"])
        for peer in state["peers"]:
            for gauge, key in ((step, "step"), (age, "heartbeat_age_s"), (sent, "sent_bytes"), (used, "utilisation"),
                               (mfu, "mfu")):
                if peer[key] is not None:
                    gauge.add_metric([run, peer["peer_id"]], peer[key])
        yield from (step, age, sent, used, mfu)
        polls = CounterMetricFamily("p2ptrain_monitor_polls", "DHT polls by the monitor", labels=["run"])
        polls.add_metric([run], state["polls"])
        yield polls
        errors = CounterMetricFamily("p2ptrain_monitor_poll_errors", "DHT polls that failed", labels=["run"])
        errors.add_metric([run], self._errors())
        yield errors


def make_registry(collector: RunCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
