"""Alert replay on long recorded runs, against the probe-by-probe algorithm (issue 39).

The claim it checks: ``qkgeom.alerts.replay`` (one vectorised pass per rule) takes time
linear in the rows, so a recorded run of 10⁵ probes replays within a few seconds, where the
probe-by-probe algorithm it replaced (one pandas group per probe, one Python step per row;
kept as tests/alert_reference.py, the tests' oracle) took 524 s on 10⁴ probes.

The run: ``--layers`` 4 layers of ``--heads`` 4 heads (layer rows and head rows), each probe
its own step, the metrics a monitor records by default (``DEFAULT_METRICS`` and those of the
default rules: 7 per layer and head, 140 rows a probe), ``metric`` as the text column
``read_metrics`` returns. Values wander around healthy levels with a spike now and then, so
the rules fire and re-arm. Rules: the defaults, a relative key-PR rule on every head and a
growth-rate rule (``logit_rate``).

Printed: per size the median (and range over ``--reps``) seconds of ``replay``, rows/s and
alerts; then on ``--old-probes`` probes both algorithms (the same alerts, checked) and the
ratio old / new; last the live check of one probe (``Alerts.check``, the same evaluation)
against the old one, in ms.

``--recorded DIR``: instead, both algorithms on every finished run under DIR (a sweep's
``runs/``), the default rules and seven more (absolute, relative, rate, per head): how many
runs give the same alerts.

    python benchmarks/alert_replay.py [--probes 10000 100000] [--old-probes 1000] [--reps 3]
    python benchmarks/alert_replay.py --recorded sweeps/stability-demo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from qkgeom.alerts import DEFAULT_RULES, Alerts, key_pr_drop, logit_rate, replay
from qkgeom.monitor import DEFAULT_METRICS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from alert_reference import ProbeByProbe, replay_probe_by_probe  # noqa: E402

METRICS = tuple(dict.fromkeys((*DEFAULT_METRICS, *(r.metric for r in DEFAULT_RULES))))
#: A healthy run's typical level of each metric (1 for any other the defaults may name).
LEVEL = {"pr_q_token": 8.0, "pr_k_token": 6.0, "contrast_token": 2.0, "pr_qk_weight": 10.0,
         "attn_entropy": 2.0, "logit_max": 20.0, "logit_delta": 1.0, "entropy_min": 1.5,
         "sink_mass": 0.1, "q_norm_max": 5.0, "k_norm_max": 5.0, "logit_bound": 25.0,
         "attn_entropy_norm": 0.6, "attn_max": 0.4}


def recorded_run(probes: int, layers: int, heads: int, seed: int = 0) -> pd.DataFrame:
    """A run's long metrics (``step, layer, head, metric, value``), one step per probe."""
    rng = np.random.default_rng(seed)
    per_probe = layers * (heads + 1) * len(METRICS)
    n = probes * per_probe
    i = np.arange(per_probe)
    metric_ix = np.tile(i % len(METRICS), probes)
    level = np.array([LEVEL.get(m, 1.0) for m in METRICS])[metric_ix]
    value = level * np.exp(rng.normal(0.0, 0.1, n))
    spike = rng.random(n) < 2e-3  # now and then a probe far off its level, either way
    value[spike] *= np.where(rng.random(spike.sum()) < 0.5, 5.0, 0.2)
    return pd.DataFrame({
        "step": np.repeat(np.arange(probes, dtype=np.int64), per_probe),
        "layer": np.tile(i // (len(METRICS) * (heads + 1)), probes),
        "head": np.tile((i // len(METRICS)) % (heads + 1) - 1, probes),
        "metric": pd.array(pa.DictionaryArray.from_arrays(  # as read_metrics returns it
            pa.array(metric_ix.astype(np.int8)), pa.array(METRICS)).cast(pa.large_string()),
            dtype="str"),
        "value": value})


def rules_for(probes: int) -> tuple:
    return (*DEFAULT_RULES, key_pr_drop(0.5, probes // 4, heads=True), logit_rate(0.5))


def timed(fn, reps: int) -> tuple[list[float], object, list[float]]:
    """Wall seconds of each rep, the last result, CPU seconds of each rep (this process:
    what a shared machine inflates least)."""
    times, cpu, out = [], [], None
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, out, cpu


def same(a: list, b: list) -> bool:
    """The same alerts in the same order (a growth rate to 1e-12: numpy's log and math's
    may differ in the last bit)."""
    def key(x):
        return (x.rule, x.step, x.layer, x.head, x.direction)
    return ([key(x) for x in a] == [key(x) for x in b]
            and np.allclose([x.value for x in a], [x.value for x in b], rtol=1e-12, atol=0))


def check_recorded(root: Path) -> None:
    """Both algorithms on every run under ``root`` with a metrics table."""
    from qkgeom.alerts import (
        attention_peak,
        entropy_collapse,
        entropy_norm_collapse,
        logit_growth,
        logit_jump,
    )
    from qkgeom.runs import find_runs, has_metrics, read_metrics

    rules = (*DEFAULT_RULES, entropy_collapse(0.5), logit_growth(8.8), logit_jump(0.59),
             logit_rate(0.5), key_pr_drop(0.5, 50), attention_peak(0.97, heads=True),
             entropy_norm_collapse(0.03, heads=True))
    runs = [r for r in find_runs(root) if has_metrics(r)]
    agree = fired = 0
    for run in runs:
        metrics = read_metrics(run)
        new, old = replay(metrics, rules), replay_probe_by_probe(metrics, rules)
        agree += same(new, old)
        fired += len(new)
    print(f"{root}: {len(runs)} recorded runs, {len(rules)} rules: {agree} of {len(runs)} "
          f"give the same alerts with both algorithms ({fired} alerts in all)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--old-probes", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--recorded", type=Path, help="compare on the runs under this folder")
    args = ap.parse_args()
    if args.recorded is not None:
        check_recorded(args.recorded)
        return
    print(f"{args.layers} layers x {args.heads} heads, {len(METRICS)} metrics "
          f"({', '.join(METRICS)}), rules: {len(rules_for(1))}")
    for probes in args.probes:
        metrics = recorded_run(probes, args.layers, args.heads)
        rules = rules_for(probes)
        times, fired, cpu = timed(lambda m=metrics, r=rules: replay(m, r), args.reps)
        med = statistics.median(times)
        print(f"replay {probes:>9,} probes {len(metrics):>12,} rows: {med:7.3f} s "
              f"({min(times):.3f}-{max(times):.3f}; CPU {statistics.median(cpu):.3f} s), "
              f"{len(metrics) / med:,.0f} rows/s, {len(fired)} alerts")
        del metrics
    metrics = recorded_run(args.old_probes, args.layers, args.heads)
    rules = rules_for(args.old_probes)
    new_t, new, _ = timed(lambda: replay(metrics, rules), args.reps)
    old_t, old, _ = timed(lambda: replay_probe_by_probe(metrics, rules), 1)
    assert same(new, old), "replay differs from the probe-by-probe algorithm"
    print(f"{args.old_probes:,} probes ({len(metrics):,} rows, {len(new)} alerts, the same): "
          f"old {old_t[0]:.2f} s, new {statistics.median(new_t):.4f} s, "
          f"old / new = {old_t[0] / statistics.median(new_t):,.0f}")
    frames = [f.drop(columns="step") for _, f in metrics.groupby("step", sort=True)][:200]
    live, ref = Alerts(rules), ProbeByProbe(rules)
    t_new = timed(lambda: [live.check(s, f, warn=False) for s, f in enumerate(frames)], 1)[0]
    t_old = timed(lambda: [ref.check(s, f) for s, f in enumerate(frames)], 1)[0]
    assert same(live.fired, ref.fired)
    print(f"live check of one probe ({len(frames[0])} rows): new {1e3 * t_new[0] / 200:.2f} "
          f"ms, old {1e3 * t_old[0] / 200:.2f} ms")


if __name__ == "__main__":
    main()
