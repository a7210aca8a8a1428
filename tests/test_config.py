"""Config: presets, overrides, validation errors, stable hash."""

from __future__ import annotations

import pytest

from qkgeom.config import PRESETS, make_config, parse_dotted
from qkgeom.errors import QKGeomError


def test_presets_validate_and_smoke_has_at_least_three_probes() -> None:
    for name in PRESETS:
        make_config(name)
    smoke = make_config("smoke")
    assert smoke.steps // smoke.probe_every + 1 >= 3


def test_overrides_win_and_nested_keys_work() -> None:
    cfg = make_config("smoke", {"model": {"n_layer": 3, "qk_init": "tied"}, "lr": 1e-3})
    assert (cfg.model.n_layer, cfg.model.qk_init, cfg.lr) == (3, "tied", 1e-3)
    assert cfg.model.n_embd == PRESETS["smoke"]["model"]["n_embd"]


def test_parse_dotted_types() -> None:
    assert parse_dotted(["model.n_layer=6", "lr=1e-3", "model.qk_init=tied"]) == {
        "model": {"n_layer": 6, "qk_init": "tied"}, "lr": 1e-3}


@pytest.mark.parametrize("over, words", [
    ({"model": {"n_embd": 30, "n_head": 4}}, "divisible"),
    ({"model": {"qk_init": "xavier"}}, "qk_init"),
    ({"steps": 0}, "steps"),
    ({"model": {"n_layer": -1}}, "n_layer"),
    ({"probe_every": 10_000}, "probe_every"),
    ({"nonsense": 1}, "unknown config key 'nonsense'"),
    ({"model": {"depth": 4}}, "unknown config key 'model.depth'"),
    ({"lr": "fast"}, "lr"),
    ({"steps": 2.5}, "steps"),
    ({"precision": "fp8"}, "precision"),
])
def test_bad_values_are_clear_errors(over: dict, words: str) -> None:
    with pytest.raises(QKGeomError, match=words):
        make_config("smoke", over)


def test_unknown_preset() -> None:
    with pytest.raises(QKGeomError, match="preset"):
        make_config("huge")


def test_hash_is_stable_and_ignores_device_and_threads() -> None:
    a = make_config("smoke")
    assert a.config_hash() == make_config("smoke").config_hash()
    assert a.config_hash() == make_config("smoke", {"threads": 2}).config_hash()
    assert a.config_hash() != make_config("smoke", {"seed": 1}).config_hash()
