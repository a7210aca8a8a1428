"""Alert rules: the monitor's early warning, one definition for live probes and for runs
already recorded (:func:`replay`), so a rule's precision and lead time can be measured on
the runs it will watch.

A rule watches one metric of each layer (or head), against an absolute threshold or one
relative to the first probe at or after ``from_step``; it fires once when its condition
starts to hold and re-arms when it clears, with a :class:`GeometryWarning` and the user's
hook. How the defaults were chosen: docs/monitor.md#alerts, docs/stability.md#alerts.
Torch-free, like the analysis that replays them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qkgeom.errors import QKGeomError
from qkgeom.metrics import METRIC_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DEFAULT_RULES", "Alert", "AlertRule", "Alerts", "GeometryWarning", "as_rules",
           "entropy_collapse", "key_pr_drop", "logit_growth", "logit_jump", "replay"]


class GeometryWarning(UserWarning):
    """Issued when an alert rule fires."""


@dataclass(frozen=True)
class AlertRule:
    """Fire when ``metric`` goes below ``below`` or above ``above`` (see the module doc)."""

    name: str
    metric: str
    below: float | None = None
    above: float | None = None
    relative: bool = False
    heads: bool = False
    from_step: int = 0

    def __post_init__(self) -> None:
        if self.metric not in METRIC_NAMES:
            raise QKGeomError(f"alert {self.name!r}: unknown metric {self.metric!r}")
        if self.below is None and self.above is None:
            raise QKGeomError(f"alert {self.name!r}: give below= and/or above=")
        if self.from_step < 0:
            raise QKGeomError(f"alert {self.name!r}: from_step must be >= 0")

    def threshold(self, baseline: float) -> tuple[float | None, float | None]:
        scale = baseline if self.relative else 1.0
        return (None if self.below is None else self.below * scale,
                None if self.above is None else self.above * scale)


@dataclass(frozen=True)
class Alert:
    """One firing: which rule, where, the value and the threshold it crossed."""

    rule: str
    metric: str
    step: int
    layer: int
    head: int
    value: float
    threshold: float
    direction: str  # "below" | "above"

    @property
    def message(self) -> str:
        where = f"layer {self.layer}" + ("" if self.head < 0 else f" head {self.head}")
        return (f"qkgeom monitor: {self.rule} at step {self.step}, {where}: {self.metric} = "
                f"{self.value:.4g} is {self.direction} {self.threshold:.4g}")


def logit_growth(limit: float, *, heads: bool = False) -> AlertRule:
    """The largest scaled attention logit of a layer above ``limit``."""
    return AlertRule(f"attention logits grew above {limit:g}", "logit_max", above=limit,
                     heads=heads)


def logit_jump(limit: float, *, heads: bool = False) -> AlertRule:
    """The RMS change of a layer's logits since the previous probe above ``limit``."""
    return AlertRule(f"attention logits moved more than {limit:g} between probes",
                     "logit_delta", above=limit, heads=heads)


def entropy_collapse(min_nats: float, *, heads: bool = False) -> AlertRule:
    """The layer-mean attention entropy below ``min_nats`` nats."""
    return AlertRule(f"attention entropy collapsed below {min_nats:g} nats", "attn_entropy",
                     below=min_nats, heads=heads)


def key_pr_drop(fraction: float, from_step: int, *, heads: bool = False) -> AlertRule:
    """Token-level PR_K below ``fraction`` of its value at the first probe at or after
    ``from_step`` (the post-transient level: small models' keys collapse early anyway)."""
    return AlertRule(f"key PR fell below {fraction:g} of its level at step {from_step}",
                     "pr_k_token", below=fraction, relative=True, heads=heads,
                     from_step=from_step)


#: From the ``calibrate`` preset's runs of the demo model (docs/stability.md#alerts): 2 × the
#: stable runs' largest logit_max and logit_delta, ½ × their smallest layer entropy.
DEFAULT_RULES = (logit_growth(74.0), logit_jump(8.8), entropy_collapse(0.59))


@dataclass
class Alerts:
    """Evaluates rules on each probe; keeps the fired alerts in ``fired``."""

    rules: tuple[AlertRule, ...] = DEFAULT_RULES
    hook: Callable[[Alert], None] | None = None
    fired: list[Alert] = field(default_factory=list)
    _baseline: dict[tuple[str, int, int], float] = field(default_factory=dict)
    _active: set[tuple[str, int, int]] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        """Metrics the rules read (the monitor measures them even if not asked to log)."""
        return {r.metric for r in self.rules}

    def check(self, step: int, frame: pd.DataFrame, *, warn: bool = True) -> list[Alert]:
        """Evaluate every rule on one probe's long frame (``layer, head, metric, value``);
        warn (unless ``warn=False``), call the hook, return the alerts fired now."""
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
                self._baseline.setdefault(key, float(value))
                alert = _crossing(rule, step, int(layer), int(head), float(value),
                                  self._baseline[key])
                if alert is None:
                    self._active.discard(key)
                elif key not in self._active:
                    self._active.add(key)
                    new.append(alert)
        for alert in new:
            self.fired.append(alert)
            if warn:
                warnings.warn(alert.message, GeometryWarning, stacklevel=3)
            if self.hook is not None:
                self.hook(alert)
        return new


def _crossing(rule: AlertRule, step: int, layer: int, head: int, value: float,
              baseline: float) -> Alert | None:
    if not math.isfinite(value):
        return None
    low, high = rule.threshold(baseline)
    for bound, direction, hit in ((low, "below", low is not None and value < low),
                                  (high, "above", high is not None and value > high)):
        if hit:
            return Alert(rule.name, rule.metric, step, layer, head, value, float(bound),
                         direction)
    return None


def replay(metrics: pd.DataFrame, rules: Iterable[AlertRule] | None = None) -> list[Alert]:
    """The alerts ``rules`` (default :data:`DEFAULT_RULES`) fire on a recorded run's long
    metrics (``step, layer, head, metric, value``: ``metrics.parquet``), probe by probe in
    step order, exactly as the monitor would have fired them live (no warnings)."""
    alerts = Alerts(as_rules(rules))
    for step, frame in metrics.sort_values("step", kind="stable").groupby("step", sort=True):
        alerts.check(int(step), frame, warn=False)
    return alerts.fired


def as_rules(rules: Iterable[AlertRule] | None) -> tuple[AlertRule, ...]:
    """``None`` -> the defaults; else the given rules (validated types)."""
    if rules is None:
        return DEFAULT_RULES
    out = tuple(rules)
    for r in out:
        if not isinstance(r, AlertRule):
            raise QKGeomError(f"alerts must be AlertRule objects, got {type(r).__name__}")
    return out
