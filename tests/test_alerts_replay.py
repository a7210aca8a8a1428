"""``replay`` (one vectorised pass per rule, issue 39) against the probe-by-probe algorithm
it replaced (tests/alert_reference.py) on random frames and on a real monitored run; the
live ``Alerts.check`` (the same evaluation, one probe at a time) against both; and the
growth-rate rules of issue 35 on hand-made frames."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from alert_reference import replay_probe_by_probe
from hypothesis import given, settings
from hypothesis import strategies as st

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

COLUMNS = ["step", "layer", "head", "metric", "value"]
METRICS = ("logit_max", "attn_entropy", "pr_k_token")
STEPS = 15  # of the monitored run


def live(metrics: pd.DataFrame, rules) -> list[Alert]:
    """The monitor's way: ``Alerts.check`` once per probe, in step order."""
    alerts = Alerts(tuple(rules))
    for step, frame in metrics.sort_values("step", kind="stable").groupby("step", sort=True):
        alerts.check(int(step), frame.drop(columns="step"), warn=False)
    return alerts.fired


def same(got: list[Alert], want: list[Alert]) -> None:
    """Equal alerts in the same order; a rate compared to 1e-12 (numpy's log and math's may
    differ in the last bit)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.value == pytest.approx(b.value, rel=1e-12, abs=1e-300)
        assert a.threshold == pytest.approx(b.threshold, rel=1e-12, abs=1e-300)
        assert (a.rule, a.metric, a.step, a.layer, a.head, a.direction, a.rate) == (
            b.rule, b.metric, b.step, b.layer, b.head, b.direction, b.rate)


VALUES = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0]),
                   st.floats(0.05, 20.0), st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0]))


@st.composite
def frames(draw) -> pd.DataFrame:
    """A recorded run's long metrics: probes at random steps (rows of a probe contiguous or
    shuffled), 1-3 layers, layer rows and head rows, now and then a row twice."""
    steps = sorted(draw(st.sets(st.integers(0, 60), min_size=1, max_size=12)))
    layers = draw(st.integers(1, 3))
    heads = [-1, *range(draw(st.integers(0, 2)))]
    rows = [(s, lay, h, m, draw(VALUES)) for s in steps for lay in range(layers)
            for h in heads for m in METRICS if draw(st.floats(0, 1)) < 0.85]
    rows += [(*rows[i][:4], draw(VALUES)) for i in draw(st.lists(
        st.integers(0, max(len(rows) - 1, 0)), max_size=3)) if rows]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    if draw(st.booleans()):
        frame = frame.sample(frac=1.0, random_state=draw(st.integers(0, 99)))
    return frame


@st.composite
def rule_sets(draw) -> tuple[AlertRule, ...]:
    rules = []
    for i in range(draw(st.integers(1, 4))):
        rate = draw(st.booleans())
        relative = not rate and draw(st.booleans())
        lo, hi = ((-0.5, 0.5) if rate else (0.2, 1.5) if relative else (0.1, 10.0))
        below = draw(st.one_of(st.none(), st.floats(lo, hi)))
        above = draw(st.floats(lo, hi)) if below is None else draw(
            st.one_of(st.none(), st.floats(lo, hi)))
        rules.append(AlertRule(f"r{i}", draw(st.sampled_from(METRICS)), below=below,
                               above=above, relative=relative, rate=rate,
                               heads=draw(st.booleans()),
                               from_step=draw(st.sampled_from([0, 0, 5, 20]))))
    return tuple(rules)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(frames(), rule_sets())
def test_replay_equals_the_probe_by_probe_algorithm(metrics, rules) -> None:
    want = replay_probe_by_probe(metrics, rules)
    same(replay(metrics, rules), want)
    same(live(metrics, rules), want)


def test_the_random_frames_exercise_every_branch() -> None:
    """The equality test is not vacuous: on a fixed seed's frames the reference fires for
    relative, rate, head and from_step rules, below and above."""
    rows = [(s, lay, h, m) for s in range(0, 40, 3) for lay in range(2) for h in (-1, 0, 1)
            for m in METRICS]
    rng = np.random.default_rng(0)
    value = (rng.choice([np.nan, 0.0, 1.0], p=[0.1, 0.1, 0.8], size=len(rows))
             * rng.uniform(0.1, 9.0, size=len(rows)))
    metrics = pd.DataFrame(rows, columns=COLUMNS[:4]).assign(value=value)
    rules = (AlertRule("rel", "pr_k_token", below=0.5, relative=True, from_step=6),
             AlertRule("rate", "logit_max", above=0.2, rate=True, heads=True),
             AlertRule("abs", "attn_entropy", below=1.0, above=7.0, from_step=9))
    want = replay_probe_by_probe(metrics, rules)
    assert {(a.rule, a.direction) for a in want} == {
        ("rel", "below"), ("rate", "above"), ("abs", "below"), ("abs", "above")}
    assert any(a.head >= 0 for a in want) and min(a.step for a in want if a.rule == "abs") >= 9
    same(replay(metrics, rules), want)
    same(live(metrics, rules), want)


def test_a_relative_baseline_is_the_first_finite_value() -> None:
    """The one change of semantics: a NaN (or inf) first probe no longer silences a
    relative rule for good; its baseline is the first finite value at or after from_step."""
    metrics = pd.DataFrame({"step": [0, 10, 20, 30, 40], "layer": 0, "head": -1,
                            "metric": "pr_k_token", "value": [9.0, math.nan, 4.0, 1.5, 3.0]})
    fired = replay(metrics, (key_pr_drop(0.5, 10),))
    assert [(a.step, a.value, a.threshold) for a in fired] == [(30, 1.5, 2.0)]


# ---------------------------------------------------------------- growth rates (issue 35)


def series(steps: list[int], values: list[float], layer: int = 0, head: int = -1,
           metric: str = "logit_max") -> pd.DataFrame:
    return pd.DataFrame({"step": steps, "layer": layer, "head": head, "metric": metric,
                         "value": values})


def fired_at(metrics: pd.DataFrame, rule: AlertRule) -> list[tuple[int, float]]:
    got = [(a.step, round(a.value, 12)) for a in replay(metrics, (rule,))]
    assert got == [(a.step, round(a.value, 12)) for a in live(metrics, (rule,))]
    return got


def test_rate_per_step_over_uneven_gaps() -> None:
    """r = (ln v_t - ln v_prev) / (t - t_prev): e at step 10 from 1 at 0 is 0.1 per step,
    e³ at step 15 is 2 / 5 = 0.4; the first probe has no rate."""
    e = math.e
    metrics = series([0, 10, 15, 35], [1.0, e, e**3, e**4])
    assert fired_at(metrics, logit_rate(0.3)) == [(15, 0.4)]
    assert fired_at(metrics, logit_rate(0.05)) == [(10, 0.1)]  # on at 0.1 and 0.4; 0.05 is not above
    falling = AlertRule("fall", "logit_max", below=-0.05, rate=True)
    assert fired_at(series([0, 4, 6], [e**2, e, 1.0]), falling) == [(4, -0.25)]


def test_a_zero_nan_or_negative_value_has_no_rate_and_clears() -> None:
    """A value that is not finite and > 0 has no logarithm: no rate there, nor at the next
    probe (its previous value is that one), and the rule re-arms."""
    e = math.e
    for bad in (0.0, math.nan, -1.0, math.inf):
        metrics = series([0, 1, 2, 3, 4, 5], [1.0, e, bad, e**2, e**4, e**6])
        assert fired_at(metrics, logit_rate(0.5)) == [(1, 1.0), (4, 2.0)]


def test_rate_from_step_and_per_key() -> None:
    """The first probe at or after from_step has no rate; each (layer, head) its own."""
    e = math.e
    metrics = pd.concat([series([0, 5, 10], [1.0, e**10, e**20]),
                         series([0, 5, 10], [1.0, 1.0, e**10], layer=1),
                         series([0, 5, 10], [1.0, e**10, e**10], head=0)])
    assert fired_at(metrics, logit_rate(1.5)) == [(5, 2.0), (10, 2.0)]
    assert [a.layer for a in replay(metrics, (logit_rate(1.5),))] == [0, 1]
    assert fired_at(metrics, logit_rate(1.5, from_step=5)) == [(10, 2.0), (10, 2.0)]
    assert fired_at(metrics, logit_rate(1.5, from_step=6)) == []  # one probe: no rate
    heads = replay(metrics, (logit_rate(1.5, heads=True),))
    assert [(a.step, a.layer, a.head) for a in heads] == [(5, 0, -1), (5, 0, 0), (10, 1, -1)]


def test_a_rate_alert_says_so() -> None:
    alerts = Alerts((logit_rate(0.1),))
    alerts.check(0, series([0], [1.0]).drop(columns="step"))
    with pytest.warns(GeometryWarning, match=r"logit_max growth rate = 0.6931/step is above "
                                             r"0.1/step"):
        (alert,) = alerts.check(1, series([1], [2.0]).drop(columns="step"))
    assert alert.rate and alert.value == pytest.approx(math.log(2))


# ---------------------------------------------------------------- a real monitored run


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[AlertRule, ...],
                                                                  list[Alert]]:
    """A tiny qkgeom GPT trained hard (lr 0.05) for 15 steps under a monitor probing every
    step, with rules of every kind; its run folder, the rules and the live alerts."""
    import torch

    from qkgeom import GPT, GPTConfig
    from qkgeom.monitor import GeometryMonitor

    vocab, T = 32, 16
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=T, vocab_size=vocab))
    probe = torch.randint(0, vocab, (4, T), generator=torch.Generator().manual_seed(1))
    rules = (*DEFAULT_RULES, logit_growth(3.0), logit_jump(0.5, heads=True),
             entropy_collapse(2.4, heads=True), entropy_norm_collapse(0.85),
             attention_peak(0.3, heads=True), key_pr_drop(0.8, 5, heads=True),
             logit_rate(0.05), AlertRule("logit rate per head", "logit_max", above=0.1,
                                         rate=True, heads=True, from_step=10))
    out = tmp_path_factory.mktemp("monitored") / "run"
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend on a shared machine
    try:
        with pytest.warns(GeometryWarning), GeometryMonitor(
                model, probe, every=1, out=out, alerts=rules, tensorboard=None, wandb=False,
                metrics=["attn_entropy"]) as mon:
            mon.start(0, total_steps=STEPS)
            for step in range(STEPS):
                x = torch.randint(0, vocab, (8, T), generator=gen)
                logits = model(x)
                logits = logits[0] if isinstance(logits, tuple) else logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                         x.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step(step + 1, loss=loss)
    finally:
        torch.set_num_threads(threads)
    return out, rules, mon.fired


def test_replay_on_a_real_run_equals_the_monitor_and_the_old_algorithm(monitored) -> None:
    from qkgeom.runs import read_alerts, read_metrics

    out, rules, fired = monitored
    metrics = read_metrics(out)
    assert metrics["step"].nunique() == STEPS + 1
    want = replay_probe_by_probe(metrics, rules)
    assert len({a.rule for a in want}) >= 6 and any(a.rate for a in want)  # not vacuous
    same(replay(metrics, rules), want)
    same(fired, want)  # what the monitor fired live
    assert [a["message"] for a in read_alerts(out)] == [a.message for a in fired]
