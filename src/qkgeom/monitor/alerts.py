"""Alert rules: turn the monitor into an early warning, not only a plot.

A rule watches one metric and fires when it crosses a threshold: absolute (``below=1.5``)
or relative to the value at the first probe (``relative=True``, ``below=0.2`` = "fell
under 20 % of where it started"). It checks the layer level (head −1) or every head.
A rule fires once when its condition starts to hold for a (layer, head) and is re-armed
when the condition clears, so a collapsed layer warns once, not at every probe.

Firing: a :class:`GeometryWarning` through :mod:`warnings` (filter it, or escalate it to an
error with ``warnings.simplefilter("error", GeometryWarning)``) and a call of the user's
hook with the :class:`Alert`.

Built-in rules:

- :func:`key_pr_collapse`: token-level PR_K of a layer below ``k`` directions -- the keys
  live in (almost) a line;
- :func:`entropy_collapse`: attention entropy of a layer below ``min_nats`` (and, with
  ``fraction``, below that share of its initial value) -- the attention-entropy-collapse
  instability of Zhai et al. (2023), where attention turns one-hot and training goes
  unstable.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES

__all__ = ["DEFAULT_RULES", "Alert", "AlertRule", "Alerts", "GeometryWarning",
           "entropy_collapse", "key_pr_collapse"]


class GeometryWarning(UserWarning):
    """Issued when an alert rule fires."""


@dataclass(frozen=True)
class AlertRule:
    """Fire when ``metric`` goes below ``below`` or above ``above``.

    ``relative``: thresholds are multiples of the (layer, head)'s value at the first probe.
    ``heads``: check every head too, not only the layer level (head −1).
    """

    name: str
    metric: str
    below: float | None = None
    above: float | None = None
    relative: bool = False
    heads: bool = False

    def __post_init__(self) -> None:
        if self.metric not in METRIC_NAMES:
            raise QKGeomError(f"alert {self.name!r}: unknown metric {self.metric!r}")
        if self.below is None and self.above is None:
            raise QKGeomError(f"alert {self.name!r}: give below= and/or above=")

    def threshold(self, initial: float) -> tuple[float | None, float | None]:
        scale = initial if self.relative else 1.0
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


def key_pr_collapse(k: float = 1.5, *, heads: bool = False) -> AlertRule:
    """Token-level PR_K below ``k`` directions (layer level unless ``heads``)."""
    return AlertRule(f"key PR collapsed below {k:g}", "pr_k_token", below=k, heads=heads)


def entropy_collapse(min_nats: float = 0.1, *, heads: bool = False) -> AlertRule:
    """Attention entropy below ``min_nats`` nats (layer mean unless ``heads``)."""
    return AlertRule(f"attention entropy collapsed below {min_nats:g} nats", "attn_entropy",
                     below=min_nats, heads=heads)


DEFAULT_RULES = (key_pr_collapse(), entropy_collapse())


@dataclass
class Alerts:
    """Evaluates rules on each probe; keeps the fired alerts in ``fired``."""

    rules: tuple[AlertRule, ...] = DEFAULT_RULES
    hook: Callable[[Alert], None] | None = None
    fired: list[Alert] = field(default_factory=list)
    _initial: dict[tuple[str, int, int], float] = field(default_factory=dict)
    _active: set[tuple[str, int, int]] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        """Metrics the rules read (the monitor measures them even if not asked to log)."""
        return {r.metric for r in self.rules}

    def check(self, step: int, frame: pd.DataFrame) -> list[Alert]:
        """Evaluate every rule on one probe's long frame; warn, call the hook, return the
        alerts fired now."""
        new: list[Alert] = []
        for rule in self.rules:
            rows = frame[frame["metric"] == rule.metric]
            if not rule.heads:
                rows = rows[rows["head"] == -1]
            for layer, head, value in zip(rows["layer"], rows["head"], rows["value"],
                                          strict=True):
                key = (rule.name, int(layer), int(head))
                self._initial.setdefault(key, float(value))
                alert = _crossing(rule, step, int(layer), int(head), float(value),
                                  self._initial[key])
                if alert is None:
                    self._active.discard(key)
                elif key not in self._active:
                    self._active.add(key)
                    new.append(alert)
        for alert in new:
            self.fired.append(alert)
            warnings.warn(alert.message, GeometryWarning, stacklevel=3)
            if self.hook is not None:
                self.hook(alert)
        return new


def _crossing(rule: AlertRule, step: int, layer: int, head: int, value: float,
              initial: float) -> Alert | None:
    if not math.isfinite(value):
        return None
    low, high = rule.threshold(initial)
    for bound, direction, hit in ((low, "below", low is not None and value < low),
                                  (high, "above", high is not None and value > high)):
        if hit:
            return Alert(rule.name, rule.metric, step, layer, head, value, float(bound),
                         direction)
    return None


def as_rules(rules: Iterable[AlertRule] | None) -> tuple[AlertRule, ...]:
    """``None`` -> the defaults; else the given rules (validated types)."""
    if rules is None:
        return DEFAULT_RULES
    out = tuple(rules)
    for r in out:
        if not isinstance(r, AlertRule):
            raise QKGeomError(f"alerts must be AlertRule objects, got {type(r).__name__}")
    return out
