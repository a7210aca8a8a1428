"""Alert rules on hand-made probe frames: when they fire, once, re-armed, and the hook."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.monitor import (
    DEFAULT_RULES,
    AlertRule,
    Alerts,
    GeometryMonitor,
    GeometryWarning,
    entropy_collapse,
    key_pr_drop,
)


def frame(values: dict[tuple[int, int, str], float]) -> pd.DataFrame:
    rows = [(layer, head, metric, v) for (layer, head, metric), v in values.items()]
    return pd.DataFrame(rows, columns=["layer", "head", "metric", "value"])


def test_key_pr_drop_watches_from_its_step_fires_once_and_rearms() -> None:
    """Relative to the post-transient level: the probes before ``from_step`` (the early
    collapse every small model's keys go through) are not checked; the baseline is the
    first probe at or after it."""
    seen = []
    alerts = Alerts((key_pr_drop(0.5, 10),), hook=seen.append)
    assert alerts.check(0, frame({(1, -1, "pr_k_token"): 0.1})) == []  # before from_step
    assert alerts.check(10, frame({(0, -1, "pr_k_token"): 5.0, (1, -1, "pr_k_token"): 4.0,
                                   (1, 0, "pr_k_token"): 0.1})) == []  # the baselines
    with pytest.warns(GeometryWarning, match=r"layer 1: pr_k_token = 1.5 is below 2"):
        fired = alerts.check(20, frame({(0, -1, "pr_k_token"): 5.0, (1, -1, "pr_k_token"): 1.5,
                                        (1, 0, "pr_k_token"): 0.05}))  # heads ignored
    assert [(a.step, a.layer, a.head, a.value, a.threshold) for a in fired] == [
        (20, 1, -1, 1.5, 2.0)]
    assert seen == fired
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # still collapsed: no second warning
        assert alerts.check(30, frame({(1, -1, "pr_k_token"): 1.2})) == []
        assert alerts.check(40, frame({(1, -1, "pr_k_token"): 3.0})) == []  # recovered
    with pytest.warns(GeometryWarning):
        assert len(alerts.check(50, frame({(1, -1, "pr_k_token"): 1.9}))) == 1  # re-armed
    assert [a.step for a in alerts.fired] == [20, 50]


def test_relative_per_head_entropy_rule() -> None:
    rule = AlertRule("entropy fell below 30 % of its start", "attn_entropy", below=0.3,
                     relative=True, heads=True)
    alerts = Alerts((rule,))
    assert alerts.check(0, frame({(0, 0, "attn_entropy"): 2.0, (0, 1, "attn_entropy"): 1.0})) == []
    with pytest.warns(GeometryWarning):
        fired = alerts.check(5, frame({(0, 0, "attn_entropy"): 0.5,  # 0.5 < 0.6: fires
                                       (0, 1, "attn_entropy"): 0.4}))  # 0.4 >= 0.3: not
    assert [(a.head, a.threshold) for a in fired] == [(0, pytest.approx(0.6))]


def test_bad_rules() -> None:
    with pytest.raises(QKGeomError, match="unknown metric"):
        AlertRule("x", "pr_v_token", below=1.0)
    with pytest.raises(QKGeomError, match="below= and/or above="):
        AlertRule("x", "attn_entropy")
    assert entropy_collapse(0.2).below == 0.2


def test_monitor_warns_and_calls_the_hook(probe_tokens) -> None:
    """A freshly initialised model has near-uniform attention: an 'entropy above' rule fires."""
    from qkgeom import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256))
    hits = []
    rule = AlertRule("attention too flat", "attn_entropy", above=1.0)
    mon = GeometryMonitor(model, probe_tokens, metrics=["pr_q_token"], alerts=[rule],
                          on_alert=hits.append, wandb=False)
    with pytest.warns(GeometryWarning, match="attention too flat"):
        mon.start(0)
    assert sorted(a.layer for a in hits) == [0, 1] and mon.fired == hits
    assert set(mon.history["metric"]) == {"pr_q_token", "attn_entropy"}  # rule's metric measured
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("off", [False, None])
def test_sinks_are_off_with_false_or_none(probe_tokens, off) -> None:
    """``tensorboard=`` and ``wandb=`` take False and None alike for "off" (False used to be
    a TypeError for TensorBoard); the default rules' metrics are measured."""
    from qkgeom import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=256))
    mon = GeometryMonitor(model, probe_tokens, metrics=["pr_q_token"], tensorboard=off,
                          wandb=off)
    assert mon.tensorboard is None and mon._wandb_sink() is None
    mon.start(0)
    mon.step(1)
    mon.probe(1)
    assert {r.metric for r in DEFAULT_RULES} <= set(mon.history["metric"])
