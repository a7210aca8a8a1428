"""The width ladder's grid expands to what docs/protocols.md#the-width-ladder says."""

from __future__ import annotations

from collections import Counter

import pytest

from qkgeom.errors import QKGeomError
from qkgeom.experiments import E1_PRESETS, experiment
from qkgeom.experiments.e1 import ladder_arm


def test_the_ladder_grid_is_the_protocols() -> None:
    specs = experiment("e1").grid("ladder").expand()
    assert len(specs) == 8 * 4
    setting = {s.run_id: (s.axes["arm"], s.config) for s in specs}
    by_arm = Counter(arm for arm, _ in setting.values())
    assert by_arm == {"w64": 8, "w128": 8, "w256": 8, "w128-tokens4x": 8}
    for arm, cfg in setting.values():
        m = cfg.model
        assert (m.n_layer, m.n_head, m.qk_init) == (4, 4, "normal")
        assert (cfg.steps, cfg.probe_every, cfg.lr, cfg.warmup_steps) == (2000, 200, 3e-3, 30)
        assert (cfg.eval_every, cfg.checkpoint_every, cfg.ref_step) == (250, 500, 500)
        width, batch, context = {"w64": (64, 16, 64), "w128": (128, 16, 64),
                                 "w256": (256, 16, 64), "w128-tokens4x": (128, 32, 128)}[arm]
        assert (m.n_embd, cfg.batch_size, m.block_size) == (width, batch, context)
        assert m.n_embd // m.n_head in (16, 32, 64)
    # the same seeds 0-7 at every setting (a seed's runs differ by the setting only) ...
    seeds = {arm: sorted(cfg.seed for a, cfg in setting.values() if a == arm) for arm in by_arm}
    assert all(s == list(range(8)) for s in seeds.values())
    # ... and seed is the outer axis: a partial ladder has whole seeds
    assert [s.config.seed for s in specs[:4]] == [0] * 4
    assert specs[0].run_id == "seed=0,arm=w64"


def test_the_w128_rung_is_the_labs_depth4_normal_run_probed_every_200() -> None:
    rung = next(s.config for s in experiment("e1").grid("ladder").expand()
                if s.axes["arm"] == "w128" and s.config.seed == 0)
    lab = next(s.config for s in experiment("e1").grid("lab").expand()
               if s.config.model.n_layer == 4 and s.config.model.qk_init == "normal")
    from dataclasses import replace

    assert replace(lab, seed=0, probe_every=200) == rung


def test_ladder_settings_and_errors() -> None:
    assert "ladder" in E1_PRESETS
    ctx = ladder_arm("w128-ctx256")  # defined, not in the preset (time)
    assert ctx["set"] == {"model.n_embd": 128, "batch_size": 4, "model.block_size": 256}
    with pytest.raises(QKGeomError, match="unknown E1 ladder setting"):
        ladder_arm("w512")
