"""Monitor Q/K geometry while you train your own transformer (no change to its code).

::

    from qkgeom.monitor import GeometryMonitor
    mon = GeometryMonitor(model, probe_batch, every=200, out="runs/mine")
    transformers.Trainer(..., callbacks=[mon.hf_callback()])          # HF Trainer
    lightning.Trainer(callbacks=[mon.lightning_callback()])            # Lightning
    for step, batch in enumerate(loader): ...; mon.step(step + 1)      # plain loop

The alert rules live in :mod:`qkgeom.alerts` and the closed loop in
:mod:`qkgeom.control.closed_loop`; the names load on first use, so ``qkgeom watch`` never
imports torch (docs/monitor.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr

_EXPORTS = {
    "GeometryMonitor": "qkgeom.monitor.monitor", "DEFAULT_EVERY": "qkgeom.monitor.monitor",
    "DEFAULT_METRICS": "qkgeom.monitor.monitor",
    **{name: "qkgeom.alerts" for name in (
        "Alert", "AlertRule", "Alerts", "DEFAULT_RULES", "GeometryWarning", "attention_peak",
        "entropy_collapse", "entropy_norm_collapse", "key_pr_drop", "logit_growth",
        "logit_jump", "logit_rate", "replay")},
    "EntropyController": "qkgeom.control.closed_loop",
    "EntropyControlCallback": "qkgeom.control.closed_loop",
    "watch": "qkgeom.monitor.watch", "ReportTo": "qkgeom.monitor.report_to",
}

__all__ = [
    "DEFAULT_EVERY", "DEFAULT_METRICS", "DEFAULT_RULES", "Alert", "AlertRule", "Alerts",
    "EntropyControlCallback", "EntropyController", "GeometryMonitor", "GeometryWarning",
    "ReportTo", "attention_peak", "entropy_collapse", "entropy_norm_collapse", "key_pr_drop",
    "logit_growth", "logit_jump", "logit_rate", "replay", "watch"
]

if TYPE_CHECKING:
    from qkgeom.alerts import (
        DEFAULT_RULES,
        Alert,
        AlertRule,
        Alerts,
        GeometryWarning,
        attention_peak,
        entropy_collapse,
        entropy_norm_collapse,
        key_pr_drop,
        logit_growth,
        logit_jump,
        logit_rate,
        replay,
    )
    from qkgeom.control.closed_loop import EntropyControlCallback, EntropyController
    from qkgeom.monitor.monitor import DEFAULT_EVERY, DEFAULT_METRICS, GeometryMonitor
    from qkgeom.monitor.report_to import ReportTo
    from qkgeom.monitor.watch import watch


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
