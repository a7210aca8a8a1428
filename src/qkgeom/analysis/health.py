"""A run's health at a glance: what ``qkgeom show`` and a single run's report open with.

A practitioner asks first whether a run is healthy, then what its geometry did: its state,
its alerts (rule, step, layer, value), whether attention collapsed (the stability
protocol's definition, docs/stability.md), its last losses and its largest logit per
layer. A monitored run's alerts are the ones it recorded (``alerts.json``, its own rules);
any other run's are the default rules replayed on its probes, exactly as the monitor
would have fired them, and the record says which.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.alerts import DEFAULT_RULES, replay
from qkgeom.analysis.kit import md_table, md_text
from qkgeom.analysis.stability.outcomes import COLLAPSE_NATS
from qkgeom.runs import ALERTS, last_losses, read_alerts, read_metrics, read_status

__all__ = ["Health", "health_lines", "health_markdown", "run_health"]

#: Firings listed per rule; more are counted (a collapsing run may fire in every layer).
SHOWN_ALERTS = 8
#: Alerts a report's table lists (a deep model may fire in every layer and head).
REPORT_ALERTS = 20


@dataclass
class Health:
    """The facts :func:`run_health` gathers; ``layers``: per layer at the last probe, its
    mean attention entropy (nats), its largest logit and whether it is collapsed."""

    run: str
    state: str | None
    step: int | None
    alerts: list[dict[str, Any]]
    alerts_from: str  # "recorded" (alerts.json) | "replayed" (default rules) | "none"
    losses: dict[str, Any]
    last_probe: int | None
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def collapsed(self) -> bool:
        """Diverged, or a layer's mean attention entropy below the protocol's bound."""
        return self.state == "diverged" or any(r["collapsed"] for r in self.layers)

    def record(self) -> dict[str, Any]:
        """The JSON form (``show --format json``'s ``health``)."""
        return {**asdict(self), "collapsed": self.collapsed,
                "collapse_nats": COLLAPSE_NATS}


def _layers(metrics: pd.DataFrame) -> tuple[int | None, list[dict[str, Any]]]:
    """Per layer at the last probe: mean entropy, largest logit, collapsed."""
    rows = metrics[(metrics["head"] == -1)
                   & metrics["metric"].isin(("attn_entropy", "logit_max"))]
    if rows.empty:
        return None, []
    last = int(rows["step"].max())
    at = rows[rows["step"] == last].pivot_table(index="layer", columns="metric",
                                               values="value", aggfunc="first")
    out = []
    for layer, r in at.iterrows():
        ent = float(r.get("attn_entropy", np.nan))
        out.append({"layer": int(layer), "entropy": ent,
                    "logit_max": float(r.get("logit_max", np.nan)),
                    "collapsed": bool(np.isfinite(ent) and ent < COLLAPSE_NATS)})
    return last, out


def _alert_record(alert: Any) -> dict[str, Any]:
    keys = ("rule", "metric", "step", "layer", "head", "value", "threshold", "direction")
    get = alert.get if isinstance(alert, dict) else lambda k: getattr(alert, k, None)
    return {k: get(k) for k in keys}


def run_health(run: str | Path) -> Health:
    """The health of the run folder ``run`` (a missing or unreadable one: a one-line
    QKGeomError from the readers)."""
    run = Path(run)
    metrics = read_metrics(run, missing_ok=True)
    status = read_status(run) or {}
    if (run / ALERTS).exists():
        alerts, source = [_alert_record(a) for a in read_alerts(run)], "recorded"
    elif metrics is not None:
        alerts, source = [_alert_record(a) for a in replay(metrics, DEFAULT_RULES)], "replayed"
    else:
        alerts, source = [], "none"
    last, layers = _layers(metrics) if metrics is not None else (None, [])
    return Health(str(run), status.get("state"), status.get("step"), alerts, source,
                  last_losses(run), last, layers)


def _losses(losses: dict[str, Any]) -> list[str]:
    """``loss 2.310 at step 400``, ``val loss …``: the last logged of each."""
    return [f"{label} {losses[k]:.3f} at step {losses[f'{k}_step']}"
            for k, label in (("loss", "loss"), ("val_loss", "val loss"))
            if losses.get(k) is not None]


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and np.isfinite(x) else "n/a"


def _alert_lines(alerts: list[dict[str, Any]]) -> list[str]:
    """One line per rule, in the order the rules first fired: its metric and threshold,
    then its firings (step, layer, head, value), the first :data:`SHOWN_ALERTS` of each."""
    by_rule: dict[str, list[dict[str, Any]]] = {}
    for a in alerts:
        by_rule.setdefault(str(a["rule"]), []).append(a)
    lines = []
    for rule, fired in by_rule.items():
        first = fired[0]
        limits = {_num(a["threshold"]) for a in fired}
        limit = (f"{first['direction']} {limits.pop()}" if len(limits) == 1
                 else f"{first['direction']} its threshold")
        cells = [f"step {a['step']} layer {a['layer']}"
                 + ("" if a.get("head") in (None, -1) else f" head {a['head']}")
                 + f" = {_num(a['value'])}" for a in fired[:SHOWN_ALERTS]]
        more = len(fired) - SHOWN_ALERTS
        lines.append(f"  alert '{rule}' ({first['metric']} {limit}), {len(fired)}×: "
                     + ", ".join(cells) + (f", … {more} more" if more > 0 else ""))
    return lines


def health_lines(h: Health) -> list[str]:
    """Plain lines, most important first: the verdict line, the alerts, losses, layers."""
    verdict = ("COLLAPSED" if h.collapsed else "no collapse") + (
        f", {len(h.alerts)} alert(s)" if h.alerts else ", no alerts")
    state = f"{h.state}" + (f" at step {h.step}" if h.step is not None else "") \
        if h.state else "no status"
    lines = [f"health: {verdict} ({state})"]
    source = {"recorded": "recorded by the run's monitor",
              "replayed": "the default rules replayed on the probes"}.get(h.alerts_from)
    lines += _alert_lines(h.alerts)
    if h.alerts:
        lines.append(f"  alerts: {source}")
    loss = _losses(h.losses)
    if loss:
        lines.append("  " + " · ".join(loss))
    if h.layers:
        cells = [f"L{r['layer']} {_num(r['logit_max'])}" + (" (collapsed)" if r["collapsed"]
                                                           else "") for r in h.layers]
        lines.append(f"  largest logit per layer at step {h.last_probe}: " + ", ".join(cells))
        low = min(h.layers, key=lambda r: r["entropy"] if np.isfinite(r["entropy"]) else 1e9)
        lines.append(f"  lowest mean attention entropy: {_num(low['entropy'])} nats in layer "
                     f"{low['layer']} (collapse: below {COLLAPSE_NATS:g} nats, or diverged)")
    return lines


def health_markdown(h: Health) -> str:
    """The report's opening section: the same facts as :func:`health_lines`."""
    verdict = "**attention collapsed**" if h.collapsed else "no collapse"
    parts = ["## Health", "",
             f"{verdict}; state {md_text(str(h.state))}"
             + (f" at step {h.step}" if h.step is not None else "") + "; "
             + (f"{len(h.alerts)} alert(s)" if h.alerts else "no alerts")
             + {"recorded": " (recorded by the run's monitor)",
                "replayed": " (the default rules replayed on the probes)"}.get(
                 h.alerts_from, "") + ".", ""]
    if h.alerts:
        rows = [[md_text(str(a["rule"])), a["step"], a["layer"],
                 "" if a.get("head") in (None, -1) else a["head"], md_text(str(a["metric"])),
                 _num(a["value"]), f"{a['direction']} {_num(a['threshold'])}"]
                for a in h.alerts[:REPORT_ALERTS]]
        parts += [md_table(["alert", "step", "layer", "head", "metric", "value", "crossed"],
                           rows), ""]
        if len(h.alerts) > REPORT_ALERTS:
            parts += [f"The first {REPORT_ALERTS} of {len(h.alerts)} alerts; every one: "
                      "`alerts.json` (a monitored run) or `qkgeom show RUN --format json`.",
                      ""]
    loss = _losses(h.losses)
    if loss:
        parts += ["Last logged: " + " · ".join(loss) + ".", ""]
    if h.layers:
        rows = [[r["layer"], _num(r["entropy"]), _num(r["logit_max"]),
                 "**yes**" if r["collapsed"] else "no"] for r in h.layers]
        parts += [f"Per layer at the last probe (step {h.last_probe}); collapsed: mean "
                  f"attention entropy below {COLLAPSE_NATS:g} nats (docs/stability.md).", "",
                  md_table(["layer", "mean attention entropy (nats)", "largest logit",
                            "collapsed"], rows), ""]
    return "\n".join(parts)
