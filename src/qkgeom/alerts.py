"""Alert rules: the monitor's early warning, one definition for live probes and for runs
already recorded (:func:`replay`), so a rule's precision and lead time can be measured on
the runs it will watch.

A rule watches one metric of each layer (or head), or its growth rate per step, against an
absolute threshold or one relative to the first finite probe at or after ``from_step``; it
fires once when its condition starts to hold and re-arms when it clears, with a
:class:`GeometryWarning` and the user's hook. A live probe and a recorded run go through
the same vectorised evaluation (a probe is a one-step frame), linear in the rows.
Mechanics: docs/monitor.md#alerts; how the defaults were chosen: docs/stability.md#alerts.
Torch-free, like the analysis that replays them.
"""

from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qkgeom.errors import QKGeomError
from qkgeom.metrics import METRIC_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DEFAULT_RULES", "RULE_FIELDS", "Alert", "AlertRule", "Alerts", "GeometryWarning",
           "as_rules", "attention_peak", "entropy_collapse", "entropy_norm_collapse",
           "key_pr_drop", "logit_growth", "logit_jump", "logit_rate", "replay"]

#: The fields of an :class:`AlertRule`, in order (the keys of a rule's mapping).
RULE_FIELDS = ("name", "metric", "below", "above", "relative", "heads", "from_step", "rate")
_UNSET: Any = object()


class GeometryWarning(UserWarning):
    """Issued when an alert rule fires."""


@dataclass(frozen=True, init=False)
class AlertRule:
    """Fire when ``metric`` (or with ``rate=True`` its growth rate per step) goes below
    ``below`` or above ``above`` (see the module doc). Every field is checked here, so a
    rule from a YAML file fails in one line naming the field, not at its first probe."""

    name: str
    metric: str
    below: float | None = None
    above: float | None = None
    relative: bool = False
    heads: bool = False
    from_step: int = 0
    rate: bool = False

    def __init__(self, name: str = _UNSET, metric: str = _UNSET, /, below: float | None = None,
                 above: float | None = None, relative: bool = False, heads: bool = False,
                 from_step: int = 0, rate: bool = False, *extra: Any, **unknown: Any) -> None:
        # name and metric positional-only: the mapping keys "name"/"metric" arrive in
        # ``unknown`` (and "self" is refused like any unknown key)
        for key, given in (("name", name), ("metric", metric)):
            if key in unknown and given is not _UNSET:
                raise QKGeomError(f"alert rule: {key} given twice")
        name = unknown.pop("name", name)
        metric = unknown.pop("metric", metric)
        if name is _UNSET:
            raise QKGeomError("alert rule: give its name (name=)")
        if not isinstance(name, str) or not name.strip():
            raise QKGeomError(f"alert rule: name must be a non-empty string, got {_show(name)}")
        where = f"alert {name!r}"
        if extra:
            raise QKGeomError(f"{where}: too many positional values; give the fields after "
                              f"the metric by name ({', '.join(RULE_FIELDS[2:])})")
        for key in unknown:
            raise QKGeomError(f"{where}: unknown field {key!r}{_did_you_mean(key, RULE_FIELDS)}")
        if metric is _UNSET:
            raise QKGeomError(f"{where}: give the metric it watches (metric=)")
        if not isinstance(metric, str) or metric not in METRIC_NAMES:
            hint = _did_you_mean(metric, METRIC_NAMES) if isinstance(metric, str) else ""
            raise QKGeomError(f"{where}: unknown metric {_show(metric)}{hint}")
        set_ = object.__setattr__
        set_(self, "name", name)
        set_(self, "metric", metric)
        set_(self, "below", _finite(where, "below", below))
        set_(self, "above", _finite(where, "above", above))
        for flag, value in (("relative", relative), ("heads", heads), ("rate", rate)):
            set_(self, flag, _boolean(where, flag, value))
        set_(self, "from_step", _step(where, from_step))
        if self.below is None and self.above is None:
            raise QKGeomError(f"{where}: give below= and/or above=")
        if self.rate and self.relative:
            raise QKGeomError(f"{where}: rate=True and relative=True do not combine (a rate "
                              "per step is scale-free already)")

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> AlertRule:
        """A rule from a mapping of its fields (an entry of a YAML/JSON config, or a rule
        recorded in a monitored run's ``config.json``), with the same checks."""
        if not isinstance(mapping, Mapping):
            raise QKGeomError(f"an alert rule must be a mapping of its fields "
                              f"({', '.join(RULE_FIELDS)}), got {type(mapping).__name__}")
        name = mapping.get("name", _UNSET)
        for key in mapping:
            if not isinstance(key, str):
                raise QKGeomError(f"alert {_show(name)}: field names must be strings, "
                                  f"got {_show(key)}")
        return cls(**mapping)

    def threshold(self, baseline: float) -> tuple[float | None, float | None]:
        """(low, high): the thresholds, times ``baseline`` for a relative rule."""
        scale = baseline if self.relative else 1.0
        return (None if self.below is None else self.below * scale,
                None if self.above is None else self.above * scale)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(word: Any, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(names), n=2, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    return ""


def _finite(where: str, name: str, value: Any) -> float | None:
    """A real finite number (an int or a float, never a bool or a string), as a float."""
    if value is None:
        return None
    if isinstance(value, str):
        raise QKGeomError(f"{where}: {name} must be a number, got the string {_show(value)} "
                          "(write it without quotes)")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise QKGeomError(f"{where}: {name} must be a number, got {_show(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise QKGeomError(f"{where}: {name} must be a finite number, got {_show(value)}")
    return x


def _boolean(where: str, name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise QKGeomError(f"{where}: {name} must be true or false, got {_show(value)}")


def _step(where: str, value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or int(value) < 0):
        raise QKGeomError(f"{where}: from_step must be a non-negative whole number of steps, "
                          f"got {_show(value)}")
    return int(value)


@dataclass(frozen=True)
class Alert:
    """One firing: which rule, where, the value (the growth rate per step for a ``rate``
    rule) and the threshold it crossed."""

    rule: str
    metric: str
    step: int
    layer: int
    head: int
    value: float
    threshold: float
    direction: str  # "below" | "above"
    rate: bool = False

    @property
    def message(self) -> str:
        where = f"layer {self.layer}" + ("" if self.head < 0 else f" head {self.head}")
        what = f"{self.metric} growth rate" if self.rate else self.metric
        unit = "/step" if self.rate else ""
        return (f"qkgeom monitor: {self.rule} at step {self.step}, {where}: {what} = "
                f"{self.value:.4g}{unit} is {self.direction} {self.threshold:.4g}{unit}")


def _g(x: Any) -> str:
    """``x`` for a rule's name: ``74`` as ``74``; a bad value as its repr (the rule's own
    check then names the field)."""
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool)
    return f"{x:g}" if ok else _show(x)


def logit_growth(limit: float, *, heads: bool = False) -> AlertRule:
    """The largest scaled attention logit of a layer above ``limit``."""
    return AlertRule(f"attention logits grew above {_g(limit)}", "logit_max", above=limit,
                     heads=heads)


def logit_jump(limit: float, *, heads: bool = False) -> AlertRule:
    """The RMS change of a layer's logits since the previous probe above ``limit``."""
    return AlertRule(f"attention logits moved more than {_g(limit)} between probes",
                     "logit_delta", above=limit, heads=heads)


def entropy_collapse(min_nats: float, *, heads: bool = False) -> AlertRule:
    """The layer-mean attention entropy below ``min_nats`` nats."""
    return AlertRule(f"attention entropy collapsed below {_g(min_nats)} nats", "attn_entropy",
                     below=min_nats, heads=heads)


def entropy_norm_collapse(fraction: float, *, heads: bool = False) -> AlertRule:
    """The attention entropy as a fraction of a uniform attention's (``attn_entropy_norm``,
    in [0, 1] at any context length) below ``fraction``."""
    return AlertRule(f"normalised attention entropy fell below {_g(fraction)}",
                     "attn_entropy_norm", below=fraction, heads=heads)


def attention_peak(weight: float, *, heads: bool = False) -> AlertRule:
    """The mean largest attention weight (``attn_max``, in (0, 1]) above ``weight``."""
    return AlertRule(f"attention peaked above {_g(weight)}", "attn_max", above=weight,
                     heads=heads)


def logit_rate(per_step: float, metric: str = "logit_max", *, heads: bool = False,
               from_step: int = 0) -> AlertRule:
    """``metric`` growing faster than ``per_step`` (d ln v / dt between consecutive probes):
    a rate does not depend on the metric's scale, so neither on the model's width."""
    return AlertRule(f"{_g(metric) if not isinstance(metric, str) else metric} grew faster "
                     f"than {_g(per_step)} per step", metric, above=per_step, rate=True,
                     heads=heads, from_step=from_step)


def key_pr_drop(fraction: float, from_step: int, *, heads: bool = False) -> AlertRule:
    """Token-level PR_K below ``fraction`` of its value at the first probe at or after
    ``from_step`` (the post-transient level: small models' keys collapse early anyway)."""
    return AlertRule(f"key PR fell below {_g(fraction)} of its level at step {_g(from_step)}",
                     "pr_k_token", below=fraction, relative=True, heads=heads,
                     from_step=from_step)


#: In quantities that do not scale with width, depth, head dimension or context, from the
#: ``calibrate`` preset's stable runs of four sizes (docs/stability.md#calibration): ½ × their
#: smallest layer normalised entropy, halfway from their most peaked attention to one-hot.
#: Protocol 1's absolute thresholds (74 / 8.8 / 0.59, one model) are the stability report's
#: comparator.
DEFAULT_RULES = (entropy_norm_collapse(0.065), attention_peak(0.92))


@dataclass
class _KeyState:
    """What one rule remembers of one (layer, head) between probes."""

    baseline: float = math.nan  # relative rules: the first finite value
    active: bool = False  # the condition held at the last probe (no re-firing)
    value: float = math.nan  # rate rules: the last value and its step
    step: float = math.nan


@dataclass
class Alerts:
    """Evaluates rules on each probe; keeps the fired alerts in ``fired``."""

    rules: tuple[AlertRule, ...] = DEFAULT_RULES
    hook: Callable[[Alert], None] | None = None
    fired: list[Alert] = field(default_factory=list)
    _state: dict[str, dict[tuple[int, int], _KeyState]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rules = as_rules(self.rules)

    @property
    def metrics(self) -> set[str]:
        """Metrics the rules read (the monitor measures them even if not asked to log)."""
        return {r.metric for r in self.rules}

    def check(self, step: int, frame: pd.DataFrame, *, warn: bool = True) -> list[Alert]:
        """Evaluate every rule on one probe's long frame (``layer, head, metric, value``);
        warn (unless ``warn=False``), call the hook, return the alerts fired now."""
        steps = np.full(len(frame), int(step), dtype=np.int64)
        new = self._evaluate(steps, frame)
        for alert in new:
            if warn:
                warnings.warn(alert.message, GeometryWarning, stacklevel=3)
            if self.hook is not None:
                self.hook(alert)
        return new

    def replay(self, metrics: pd.DataFrame) -> list[Alert]:
        """Take up a recorded run's long metrics (``step, layer, head, metric, value``)
        probe by probe in step order, as if checked live but without warnings or the hook:
        returns the alerts they fire, and the rules' state (baselines, active conditions,
        the previous values of rate rules) continues from them, so a resumed monitor
        fires what an uninterrupted one would."""
        if metrics["step"].isna().any():  # no probe step: never checked (as groupby drops it)
            metrics = metrics[metrics["step"].notna()]
        return self._evaluate(metrics["step"].to_numpy().astype(np.int64, copy=False), metrics)

    def _evaluate(self, steps: np.ndarray, frame: pd.DataFrame) -> list[Alert]:
        """The alerts of rows in the order of ``steps`` (rows of one step in frame order),
        as if checked probe by probe; the state carries over to the next call."""
        metric = frame["metric"]
        layer = frame["layer"].to_numpy().astype(np.int64, copy=False)
        head = frame["head"].to_numpy().astype(np.int64, copy=False)
        value = frame["value"].to_numpy(dtype=np.float64, na_value=np.nan)
        layer_row = head == -1
        of_metric: dict[str, np.ndarray] = {}
        found = []  # per rule: (rule index, row indices, compared values, thresholds, below?)
        for i, rule in enumerate(self.rules):
            if rule.metric not in of_metric:
                of_metric[rule.metric] = (metric == rule.metric).to_numpy(dtype=bool,
                                                                          na_value=False)
            mask = of_metric[rule.metric]
            if not rule.heads:
                mask = mask & layer_row
            if rule.from_step > 0:
                mask = mask & (steps >= rule.from_step)
            rows = np.flatnonzero(mask)
            if len(rows):
                state = self._state.setdefault(rule.name, {})
                found.append((i, *_fires(rule, rows, steps, layer, head, value, state)))
        if not found:
            return []
        rule_ix = np.concatenate([np.full(len(f[1]), f[0]) for f in found])
        rows, x, bound, low = (np.concatenate([f[k] for f in found]) for k in (1, 2, 3, 4))
        # probe by probe: by step, then rule, then row (a stable sort keeps rows in order)
        new = []
        for k in np.lexsort((rows, rule_ix, steps[rows])).tolist():
            rule, j = self.rules[rule_ix[k]], rows[k]
            new.append(Alert(rule.name, rule.metric, int(steps[j]), int(layer[j]),
                             int(head[j]), float(x[k]), float(bound[k]),
                             "below" if low[k] else "above", rule.rate))
        self.fired += new
        return new


def _fires(rule: AlertRule, rows: np.ndarray, steps: np.ndarray, layer: np.ndarray,
           head: np.ndarray, value: np.ndarray, state: dict[tuple[int, int], _KeyState]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One rule on its rows (indices into the columns, ascending): per (layer, head) in step
    order, where the condition starts to hold. Returns the rows that fire, the value each
    compared (the value or its rate), its threshold and whether it went below."""
    t, lay, hd, v = steps[rows], layer[rows], head[rows], value[rows]
    # group rows by (layer, head), each group in step order then row order (stable sorts)
    by_step = np.argsort(t, kind="stable")
    key = (lay - lay.min()) * (int(hd.max() - hd.min()) + 1) + (hd - hd.min())
    if key.max() < 2**15:  # numpy sorts 16-bit integers stably in linear time (radix)
        key = key.astype(np.int16)
    s = by_step[np.argsort(key[by_step], kind="stable")]
    k, t, v = key[s], t[s], v[s]
    start = np.ones(len(s), dtype=bool)
    start[1:] = k[1:] != k[:-1]
    starts = np.flatnonzero(start)
    group = np.cumsum(start) - 1
    keys = list(zip(lay[s[starts]].tolist(), hd[s[starts]].tolist(), strict=True))
    carried = [state.get(key_, _KeyState()) for key_ in keys]
    finite = np.isfinite(v)
    if rule.rate:  # d ln v / dt since the previous probe of the same key
        pv = np.empty_like(v)
        pt = np.empty(len(v), dtype=np.float64)
        pv[1:], pt[1:] = v[:-1], t[:-1]
        pv[starts] = [c.value for c in carried]
        pt[starts] = [c.step for c in carried]
        ok = finite & (v > 0) & np.isfinite(pv) & (pv > 0) & (t > pt)
        x = np.full(len(v), np.nan)
        x[ok] = (np.log(v[ok]) - np.log(pv[ok])) / (t[ok] - pt[ok])
    else:
        x = v
    base = np.array([c.baseline for c in carried])
    if rule.relative:  # the first finite value of each key, unless one is carried
        first = np.minimum.reduceat(np.where(finite, np.arange(len(v)), len(v)), starts)
        fresh = np.isnan(base) & (first < len(v))
        base[fresh] = v[first[fresh]]
    scale = base[group] if rule.relative else 1.0
    lo = np.nan if rule.below is None else rule.below * scale  # NaN: never crossed
    hi = np.nan if rule.above is None else rule.above * scale
    ok = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        low, high = ok & (x < lo), ok & (x > hi)
    hit = low | high
    before = np.empty_like(hit)
    before[1:] = hit[:-1]
    before[starts] = [c.active for c in carried]
    fire = np.flatnonzero(hit & ~before)
    ends = np.append(starts[1:], len(s)) - 1
    for key_, g_end, b in zip(keys, ends.tolist(), base.tolist(), strict=True):
        state[key_] = _KeyState(b, bool(hit[g_end]), float(v[g_end]), float(t[g_end]))
    threshold = np.where(low, lo, hi)[fire]
    return rows[s[fire]], x[fire], threshold, low[fire]


def replay(metrics: pd.DataFrame, rules: Iterable[AlertRule] | None = None) -> list[Alert]:
    """The alerts ``rules`` (default :data:`DEFAULT_RULES`) fire on a recorded run's long
    metrics (``step, layer, head, metric, value``: ``metrics.parquet``), probe by probe in
    step order, exactly as the monitor would have fired them live (no warnings); one
    vectorised pass per rule."""
    return Alerts(as_rules(rules)).replay(metrics)


def as_rules(rules: Iterable[AlertRule | Mapping[str, Any]] | None) -> tuple[AlertRule, ...]:
    """``None`` -> the defaults; else the given rules, each an :class:`AlertRule` or a
    mapping of its fields (:meth:`AlertRule.from_dict`); names must be unique (an alert
    names its rule)."""
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, (AlertRule, Mapping, str, bytes)) or not isinstance(rules, Iterable):
        raise QKGeomError(f"alerts must be a list of rules (AlertRule objects or mappings of "
                          f"their fields), got {type(rules).__name__}")
    out = []
    for r in rules:
        if isinstance(r, Mapping):
            r = AlertRule.from_dict(r)
        elif not isinstance(r, AlertRule):
            raise QKGeomError(f"alerts must be AlertRule objects or mappings of their fields, "
                              f"got {type(r).__name__}")
        if any(r.name == o.name for o in out):
            raise QKGeomError(f"two alert rules are named {r.name!r}; give each its own name")
        out.append(r)
    return tuple(out)
