"""The probe-by-probe alert algorithm that :func:`qkgeom.alerts.replay` replaced (issue 39),
kept as the oracle of the equality tests and the baseline of benchmarks/alert_replay.py.

Today's ``Alerts.check`` and ``replay`` before the rewrite, row by row in Python, with two
changes, each marked: a relative rule's baseline is the first *finite* value at or after
``from_step`` (it was the first value, so a NaN first probe silenced the rule for good), and
the growth-rate rules (``rate=True``) added since. Slow on purpose: simple to read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd

from qkgeom.alerts import Alert, AlertRule


class ProbeByProbe:
    """One rule set's state, one probe at a time (the old ``Alerts``)."""

    def __init__(self, rules: Iterable[AlertRule]) -> None:
        self.rules = tuple(rules)
        self.fired: list[Alert] = []
        self.baseline: dict[tuple[str, int, int], float] = {}
        self.active: set[tuple[str, int, int]] = set()
        self.prev: dict[tuple[str, int, int], tuple[float, int]] = {}

    def check(self, step: int, frame: pd.DataFrame) -> list[Alert]:
        new: list[Alert] = []
        for rule in self.rules:
            if step < rule.from_step:
                continue
            rows = frame[frame["metric"] == rule.metric]
            if not rule.heads:
                rows = rows[rows["head"] == -1]
            for layer, head, value in zip(rows["layer"], rows["head"], rows["value"],
                                          strict=True):
                key = (rule.name, int(layer), int(head))
                value = float(value)
                if math.isfinite(value):  # change 1: the first finite value
                    self.baseline.setdefault(key, value)
                x = value
                if rule.rate:  # change 2: the growth rate since the key's previous probe
                    prev = self.prev.get(key)
                    self.prev[key] = (value, step)
                    x = math.nan
                    if (prev is not None and math.isfinite(value) and value > 0
                            and math.isfinite(prev[0]) and prev[0] > 0 and step > prev[1]):
                        x = (math.log(value) - math.log(prev[0])) / (step - prev[1])
                alert = crossing(rule, step, int(layer), int(head), x,
                                 self.baseline.get(key, math.nan))
                if alert is None:
                    self.active.discard(key)
                elif key not in self.active:
                    self.active.add(key)
                    new.append(alert)
        self.fired += new
        return new


def crossing(rule: AlertRule, step: int, layer: int, head: int, value: float,
             baseline: float) -> Alert | None:
    if not math.isfinite(value):
        return None
    scale = baseline if rule.relative else 1.0
    low = None if rule.below is None else rule.below * scale
    high = None if rule.above is None else rule.above * scale
    for bound, direction, hit in ((low, "below", low is not None and value < low),
                                  (high, "above", high is not None and value > high)):
        if hit:
            return Alert(rule.name, rule.metric, step, layer, head, value, float(bound),
                         direction, rule.rate)
    return None


def replay_probe_by_probe(metrics: pd.DataFrame, rules: Iterable[AlertRule]) -> list[Alert]:
    """The old ``replay``: the metrics grouped by step, each probe checked in step order."""
    alerts = ProbeByProbe(rules)
    for step, frame in metrics.sort_values("step", kind="stable").groupby("step", sort=True):
        alerts.check(int(step), frame)
    return alerts.fired
