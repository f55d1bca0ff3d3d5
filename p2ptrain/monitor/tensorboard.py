"""The run's progress as TensorBoard event files (``p2ptrain monitor --tensorboard DIR``).

The monitor writes them rather than the leader: it already folds the whole run's heartbeats into one series,
and it stays one process while leaders change under churn. Scalars per step under ``train/`` (loss, measured
and predicted step time, tokens/s) and the monitor's events (joins, leaves, re-plans) as text. A step is
written once, when a later step has been seen (its step time is then the median over all its trainers), and
the rest on ``close``. Needs the optional ``tensorboardX`` (``pip install 'p2ptrain[tensorboard]'``): small,
no TensorFlow.
"""

from __future__ import annotations

from typing import Any

from p2ptrain.errors import ConfigError

FLUSH_S = 5  # tensorboardX writes from a queue in its own thread and flushes its file this often
SERIES = {"loss": "train/loss", "step_time_s": "train/step_time_s", "predicted_step_s": "train/predicted_step_s",
          "tokens_per_s": "train/tokens_per_s"}


class TensorBoardLog:
    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs tensorboardX: pip install 'p2ptrain[tensorboard]'") from None
        self._writer = SummaryWriter(logdir, flush_secs=FLUSH_S)
        self._written: dict[str, int] = {}  # series -> last step written
        self._events = 0  # events written (the view's ``events_total`` counts those it dropped too)

    def write(self, state: dict[str, Any], final: bool = False) -> None:
        """Append what ``state`` (``RunView.state()``) has that is not written yet."""
        series = state["series"]
        last_step = max((points[-1][0] for points in series.values() if points), default=0)
        for key, tag in SERIES.items():
            for step, value in series[key]:
                if self._written.get(key, 0) < step and (step < last_step or final):
                    self._writer.add_scalar(tag, value, step)
                    self._written[key] = step
        new = state["events_total"] - self._events
        for event in state["events"][-new:] if new > 0 else []:
            self._writer.add_text(f"events/{event['kind']}", event["text"], event["step"], walltime=event["time"])
        self._events = state["events_total"]

    def close(self, state: dict[str, Any]) -> None:
        self.write(state, final=True)
        self._writer.close()
