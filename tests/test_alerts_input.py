"""Alert rules from user input (issue 39): every field checked when the rule is made, in a
Python call, a mapping from a YAML/JSON file or the monitor's ``alerts=``; each bad value
one line naming the rule and the field, and nothing written."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from qkgeom import alerts as alerts_module
from qkgeom.alerts import (
    DEFAULT_RULES,
    RULE_FIELDS,
    AlertRule,
    Alerts,
    as_rules,
    attention_peak,
    entropy_collapse,
    entropy_norm_collapse,
    logit_growth,
    logit_rate,
    replay,
)
from qkgeom.errors import QKGeomError

GOOD = {"name": "big logits", "metric": "logit_max", "above": 74}

# (field, bad value, words the message must hold): each one bad value of issue 39
BAD = [
    ("above", "74", "a number, got the string '74'"),  # a quoted number from YAML
    ("above", [1, 2], "a number, got [1, 2]"),
    ("above", 1e400, "finite number, got inf"),  # 1e400 is inf in Python
    ("above", 10**400, "finite number"),  # an int too large for a float
    ("above", math.nan, "finite number, got nan"),
    ("above", math.inf, "finite number, got inf"),
    ("below", -math.inf, "finite number, got -inf"),
    ("above", True, "a number, got True"),
    ("below", {"x": 1}, "a number"),
    ("from_step", "3", "non-negative whole number of steps, got '3'"),
    ("from_step", math.nan, "got nan"),
    ("from_step", 3.0, "got 3.0"),
    ("from_step", -1, "got -1"),
    ("from_step", True, "got True"),
    ("heads", "no", "true or false, got 'no'"),
    ("relative", "false", "true or false, got 'false'"),
    ("rate", "yes", "true or false, got 'yes'"),
    ("heads", 1, "true or false, got 1"),
    ("metric", "logit_mx", "unknown metric 'logit_mx'; did you mean 'logit_max'"),
    ("metric", 5, "unknown metric 5"),
    ("severity", "high", "unknown field 'severity'"),
    ("from_steps", 3, "unknown field 'from_steps'; did you mean 'from_step'?"),
]


def one_line(exc: pytest.ExceptionInfo[QKGeomError], *words: str) -> str:
    text = str(exc.value)
    assert "\n" not in text
    for w in words:
        assert w in text, (w, text)
    return text


@pytest.mark.parametrize(("key", "value", "words"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_field_is_one_line_naming_the_rule_and_the_field(key, value, words) -> None:
    fields = {**GOOD, key: value}
    with pytest.raises(QKGeomError) as direct:  # a Python call
        AlertRule(**fields)
    one_line(direct, "'big logits'", key, words)
    with pytest.raises(QKGeomError) as mapped:  # a mapping (a config file's entry)
        AlertRule.from_dict(fields)
    assert str(mapped.value) == str(direct.value)
    with pytest.raises(QKGeomError) as listed:  # the monitor's and replay's alerts=
        as_rules([fields])
    assert str(listed.value) == str(direct.value)


@pytest.mark.parametrize(("fields", "words"), [
    ({"metric": "logit_max", "above": 1}, ("give its name",)),
    ({"name": "", "metric": "logit_max", "above": 1}, ("name must be a non-empty string",)),
    ({"name": 5, "metric": "logit_max", "above": 1}, ("name must be", "got 5")),
    ({"name": "x", "above": 1}, ("'x'", "give the metric")),
    ({"name": "x", "metric": "logit_max"}, ("'x'", "give below= and/or above=")),
    ({"name": "x", "metric": "logit_max", "above": 1, "relative": True, "rate": True},
     ("'x'", "rate=True and relative=True do not combine")),
    ({"name": "x", "metric": "logit_max", "above": 1, "self": 2}, ("unknown field 'self'",)),
])
def test_missing_and_conflicting_fields(fields, words) -> None:
    with pytest.raises(QKGeomError) as exc:
        AlertRule.from_dict(fields)
    one_line(exc, *words)


def test_positional_calls() -> None:
    assert AlertRule("x", "attn_entropy", 0.5) == AlertRule("x", "attn_entropy", below=0.5)
    with pytest.raises(QKGeomError) as exc:
        AlertRule("x", "attn_entropy", 0.5, None, False, False, 0, False, "extra")
    one_line(exc, "'x'", "too many positional values")
    with pytest.raises(QKGeomError) as exc:
        AlertRule("x", "attn_entropy", name="y", below=0.5)
    one_line(exc, "name given twice")


def test_numbers_from_yaml_and_json_files() -> None:
    """What the loaders make of the values a user types: YAML's quoted 74, its 1e400 (a
    string to PyYAML), ``.nan``, ``no``; JSON's 1e400 (inf)."""
    text = """
- {name: a, metric: logit_max, above: '74'}
- {name: b, metric: logit_max, above: 1e400}
- {name: c, metric: logit_max, above: .nan}
- {name: d, metric: logit_max, above: 74, heads: 'no'}
- {name: e, metric: logit_max, above: 74, from_step: '3'}
"""
    fields = {"a": "above", "b": "above", "c": "above", "d": "heads", "e": "from_step"}
    for entry in yaml.safe_load(text):
        with pytest.raises(QKGeomError) as exc:
            as_rules([entry])
        one_line(exc, repr(entry["name"]), fields[entry["name"]])
    with pytest.raises(QKGeomError) as exc:
        as_rules(json.loads('[{"name": "j", "metric": "logit_max", "above": 1e400}]'))
    one_line(exc, "'j'", "above must be a finite number, got inf")
    good = yaml.safe_load("[{name: ok, metric: logit_max, above: 74, heads: yes}]")
    assert as_rules(good) == (AlertRule("ok", "logit_max", above=74.0, heads=True),)


def test_good_values_are_normalised_and_the_rule_stays_frozen_and_hashable() -> None:
    rule = AlertRule("x", "logit_max", above=np.int64(74), heads=np.bool_(True),
                     from_step=np.int64(5))
    assert (rule.above, rule.heads, rule.from_step) == (74.0, True, 5)
    assert type(rule.above) is float and type(rule.from_step) is int
    assert rule == AlertRule("x", "logit_max", above=74.0, heads=True, from_step=5)
    assert len({rule, AlertRule.from_dict(dict(rule.__dict__))}) == 1  # a recorded rule reads back
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.above = 1.0  # type: ignore[misc]
    assert dataclasses.replace(rule, above=80).above == 80.0
    assert tuple(f.name for f in dataclasses.fields(AlertRule)) == RULE_FIELDS
    with pytest.raises(QKGeomError, match="'x': above must be a finite number"):
        dataclasses.replace(rule, above=math.inf)


def test_the_constructors_check_their_numbers() -> None:
    """A bad threshold fails in the rule's check, naming the field, not while the name is
    formatted (``f"{'74':g}"`` would be a ValueError)."""
    with pytest.raises(QKGeomError) as exc:
        logit_growth("74")  # type: ignore[arg-type]
    one_line(exc, "above must be a number, got the string '74'")
    with pytest.raises(QKGeomError) as exc:
        entropy_collapse(math.nan)
    one_line(exc, "below must be a finite number, got nan")
    with pytest.raises(QKGeomError) as exc:
        logit_rate(0.1, metric="logit_maximum")
    one_line(exc, "unknown metric 'logit_maximum'; did you mean 'logit_max'?")


def test_the_scale_free_constructors() -> None:
    assert entropy_norm_collapse(0.3) == AlertRule(
        "normalised attention entropy fell below 0.3", "attn_entropy_norm", below=0.3)
    assert attention_peak(0.9, heads=True) == AlertRule(
        "attention peaked above 0.9", "attn_max", above=0.9, heads=True)
    r = logit_rate(0.05, from_step=100)
    assert (r.metric, r.above, r.below, r.rate, r.relative, r.from_step) == (
        "logit_max", 0.05, None, True, False, 100)
    assert len({r.name for r in (entropy_norm_collapse(0.3), attention_peak(0.9), r)}) == 3


def test_any_recorded_metric_name_is_accepted(monkeypatch) -> None:
    """No list of its own: a name metrics.py adds (the monitor's ``logit_bound``) is a
    rule's metric as soon as it is there."""
    names = tuple(dict.fromkeys((*alerts_module.METRIC_NAMES, "logit_bound")))
    monkeypatch.setattr(alerts_module, "METRIC_NAMES", names)
    assert logit_rate(0.05, metric="logit_bound").metric == "logit_bound"


def test_rule_lists() -> None:
    assert as_rules(None) == DEFAULT_RULES
    assert as_rules(()) == ()
    for bad in (logit_growth(74), GOOD, "logit_max", 5):
        with pytest.raises(QKGeomError) as exc:
            as_rules(bad)  # type: ignore[arg-type]
        one_line(exc, "alerts must be a list of rules")
    with pytest.raises(QKGeomError) as exc:
        as_rules([logit_growth(74), 5])  # type: ignore[list-item]
    one_line(exc, "got int")
    with pytest.raises(QKGeomError) as exc:
        as_rules([GOOD, {**GOOD, "above": 80}])  # an alert names its rule
    one_line(exc, "two alert rules are named 'big logits'")
    with pytest.raises(QKGeomError) as exc:
        AlertRule.from_dict([("name", "x")])  # type: ignore[arg-type]
    one_line(exc, "must be a mapping of its fields")
    with pytest.raises(QKGeomError) as exc:
        AlertRule.from_dict({**GOOD, 3: 1})
    one_line(exc, "'big logits'", "field names must be strings, got 3")
    with pytest.raises(QKGeomError) as exc:
        Alerts(rules=[{**GOOD, "heads": "no"}])  # type: ignore[list-item]
    one_line(exc, "heads must be true or false")
    with pytest.raises(QKGeomError) as exc:
        replay(pd.DataFrame(columns=["step", "layer", "head", "metric", "value"]),
               [{**GOOD, "above": "74"}])  # type: ignore[list-item]
    one_line(exc, "above must be a number")


def test_the_monitor_refuses_bad_rules_before_writing(tmp_path: Path) -> None:
    """``GeometryMonitor(alerts=...)``: rules as objects or as mappings loaded from a file,
    checked before anything is written."""
    import torch

    from qkgeom import GPT, GPTConfig
    from qkgeom.monitor import GeometryMonitor

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16))
    probe = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "run"
    for bad in ({**GOOD, "above": "74"}, {**GOOD, "from_step": math.nan},
                {**GOOD, "severity": "high"}):
        with pytest.raises(QKGeomError) as exc:
            GeometryMonitor(model, probe, out=out, alerts=[bad], tensorboard=None,
                            wandb=False)
        one_line(exc, "'big logits'")
        assert not out.exists() and list(tmp_path.iterdir()) == []
    mon = GeometryMonitor(model, probe, out=out, alerts=[GOOD], tensorboard=None, wandb=False)
    assert mon.alerts.rules == (AlertRule("big logits", "logit_max", above=74.0),)
    mon.start(0, total_steps=1)
    mon.close()
    recorded = json.loads((out / "config.json").read_text())["monitor"]["alerts"]
    assert as_rules(recorded) == mon.alerts.rules  # the recorded rules read back
