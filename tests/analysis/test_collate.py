"""collate / trajectories: one long table, exclusions listed, seed means with t-intervals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as sst

from qkgeom.analysis import collate, runs_table, trajectories
from qkgeom.errors import QKGeomError

from .conftest import monotone_values, write_run, write_sweep


def test_collate_columns_and_excluded_diverged_run(all_rise):
    data = collate(all_rise)
    table = data.metrics
    for col in ("run_id", "depth", "qk_init", "seed", "step", "layer", "head", "metric",
                "value", "state"):
        assert col in table.columns
    assert set(table["state"]) == {"done"}
    assert table["run_id"].nunique() == 9
    assert "n_layer4-qk_init-normal-seed9" not in set(table["run_id"])
    ex = data.excluded
    assert list(ex["run_id"]) == ["n_layer4-qk_init-normal-seed9"]
    assert ex.iloc[0]["state"] == "diverged"
    assert ex.iloc[0]["excluded"].startswith("diverged at step 51")


def test_runs_table_facts(all_rise):
    runs = runs_table(all_rise).set_index("run_id")
    r = runs.loc["n_layer4-qk_init-tied-seed1"]
    # the default reference: 25 % of the run's 100 steps (not the end of warm-up, 20)
    assert (r["depth"], r["qk_init"], r["seed"], r["ref_step"]) == (4, "tied", 1, 25)
    assert r["tokens"] == 100 * 4 * 16
    assert r["train_seconds"] == pytest.approx(100 * 4 * 16 / 640.0)
    assert r["excluded"] == ""
    assert set(runs["variant"]) == {""}


def test_missing_and_unlisted_and_running_runs(tmp_path):
    root = tmp_path / "sw"
    write_run(root, "a", 2, "normal", 0, monotone_values())
    write_run(root, "b", 2, "normal", 1, monotone_values(), state="running")
    write_run(root, "unlisted", 2, "normal", 2, monotone_values())
    write_sweep(root, [{"run_id": "a"}, {"run_id": "b"},
                       {"run_id": "ghost", "axes": {"model.n_layer": 2, "seed": 3}}])
    data = collate(root)
    assert set(data.metrics["run_id"]) == {"a", "unlisted"}
    reasons = data.excluded.set_index("run_id")["excluded"]
    assert reasons["ghost"].startswith("not started")
    assert reasons["b"].startswith("incomplete (running")
    assert set(collate(root, include_incomplete=True).metrics["run_id"]) == {"a", "b",
                                                                             "unlisted"}


def test_reference_step_explicit_overrides_warmup(tmp_path):
    root = tmp_path / "ref"
    write_run(root, "a", 2, "normal", 0, monotone_values(), reference_step=35)
    runs = runs_table(root)
    assert runs.iloc[0]["ref_step"] == 35


def test_runs_differing_in_other_settings_are_not_averaged(tmp_path):
    root = tmp_path / "lr"
    write_run(root, "a", 2, "normal", 0, monotone_values(), lr=1e-3)
    write_run(root, "b", 2, "normal", 0, monotone_values(), lr=3e-3)
    data = collate(root)
    assert set(data.metrics["variant"]) == {"lr=0.001", "lr=0.003"}
    tr = trajectories(data, "pr_q_weight")
    assert set(tr["n_seeds"]) == {1}


def test_trajectories_t_interval_and_single_seed(tmp_path):
    rng = np.random.default_rng(0)
    offsets = rng.normal(size=3)

    def values_for(seed):
        base = monotone_values()
        return lambda layer, step, metric, head: base(layer, step, metric, head) + offsets[seed]

    root = tmp_path / "t"
    for s in range(3):
        write_run(root, f"r{s}", 2, "normal", s, values_for(s))
    write_run(root, "lonely", 2, "tied", 0, monotone_values())
    write_sweep(root, [{"run_id": f"r{s}"} for s in range(3)] + [{"run_id": "lonely"}])
    tr = trajectories(collate(root), "pr_k_weight")
    assert len(tr) == 2 * 2 * 11  # inits x layers x steps
    row = tr[(tr["qk_init"] == "normal") & (tr["layer"] == 1) & (tr["step"] == 30)].iloc[0]
    x = 8.0 - 0.05 * 30 + offsets
    half = sst.t.ppf(0.975, 2) * x.std(ddof=1) / np.sqrt(3)
    assert row["mean"] == pytest.approx(x.mean())
    assert row["ci_low"] == pytest.approx(x.mean() - half)
    assert row["ci_high"] == pytest.approx(x.mean() + half)
    assert row["n_seeds"] == 3
    lonely = tr[tr["qk_init"] == "tied"]
    assert lonely["ci_low"].isna().all() and (lonely["n_seeds"] == 1).all()
    heads = trajectories(collate(root), "pr_qk_weight", head=None)
    assert set(heads["head"]) == {-1, 0, 1, 2}


def test_bare_runs_folder_without_sweep_json(tmp_path):
    root = tmp_path / "bare"
    write_run(root, "a", 2, "normal", 0, monotone_values())
    assert set(collate(root).metrics["run_id"]) == {"a"}
    assert collate(root).sweep == {}


def test_not_a_sweep_is_a_clear_error(tmp_path):
    with pytest.raises(QKGeomError, match="no runs found"):
        collate(tmp_path)
    (tmp_path / "sweep.json").write_text("{not json")
    with pytest.raises(QKGeomError, match="not valid JSON"):
        collate(tmp_path)


@pytest.mark.parametrize("runs", [
    [{"run_id": "a", "dir": "elsewhere"}],  # a run naming its own folder
    ["a"],  # bare ids
    {"a": {"model.n_layer": 2}},  # runs as a mapping
])
def test_an_older_sweep_json_shape_is_refused_in_one_line(tmp_path, runs):
    """One sweep.json shape: an older one is a one-line error saying what to do, and no run
    folder it names is read."""
    root = tmp_path / "old"
    write_run(root, "a", 2, "normal", 0, monotone_values())
    (root / "sweep.json").write_text(json.dumps({"grid": {}, "runs": runs}))
    with pytest.raises(QKGeomError, match="not a sweep record of this qkgeom"):
        collate(root)


def test_failed_run_reason_carries_the_runner_error(tmp_path):
    root = tmp_path / "f"
    write_run(root, "a", 2, "normal", 0, monotone_values())
    bad = write_run(root, "b", 2, "normal", 1, monotone_values())
    (bad / "status.json").write_text(json.dumps(
        {"state": "failed", "step": 40, "steps": 100, "error": "RuntimeError: out of memory"}))
    write_sweep(root, [{"run_id": "a"}, {"run_id": "b"}], {"seed": [0, 1]})
    data = collate(root)
    reason = data.excluded.set_index("run_id").loc["b", "excluded"]
    assert reason == "failed at step 40: RuntimeError: out of memory"
    assert data.name == "f"


def test_relative_sweep_path_finds_every_run_once(all_rise, monkeypatch):
    """`qkgeom report sweeps/x` from the folder above: the runs sweep.json lists are found
    once, not looked up under sweeps/x/sweeps/x/ (a bug the demo hit)."""
    absolute = runs_table(all_rise)
    monkeypatch.chdir(all_rise.parent)
    relative = runs_table(all_rise.name)
    assert len(relative) == len(absolute)
    assert list(relative["excluded"]) == list(absolute["excluded"])
    assert "not started" not in " ".join(relative["excluded"])


def test_a_config_field_missing_from_older_runs_takes_its_default(tmp_path):
    """A run written before a config field existed and one written after (with the field at
    its default) are the same setting, not two variants."""
    from qkgeom.analysis.collate import runs_table
    from qkgeom.config import TrainConfig

    root = tmp_path / "mixed"
    write_run(root, "old", 2, "normal", 0, monotone_values())  # no key_control section
    write_run(root, "new", 2, "normal", 1, monotone_values(),
              extra_cfg={"key_control": TrainConfig().to_dict()["key_control"]})
    write_run(root, "other", 2, "normal", 2, monotone_values(),
              extra_cfg={"key_control": {"mode": "hold", "level": "weight"}})
    variants = runs_table(root).set_index("run_id")["variant"]
    assert variants["old"] == variants["new"] == "key_control.level=token,key_control.mode=none"
    assert variants["other"] == "key_control.level=weight,key_control.mode=hold"


def test_the_runs_table_is_generic_and_keeps_each_runs_flat_config(tmp_path):
    """E3's pairing is E3's (qkgeom.analysis.e3.arms): the runs table carries each run's
    flattened config, defaults filled in, and no pairing columns."""
    root = tmp_path / "generic"
    write_run(root, "a", 2, "normal", 0, monotone_values(),
              extra_cfg={"key_control": {"mode": "hold"}})
    runs = runs_table(root).set_index("run_id")
    assert not {"pair_key", "cell_key", "control", "key_control"} & set(runs.columns)
    config = runs.loc["a", "config"]
    assert config["key_control.mode"] == "hold" and config["model.n_layer"] == 2
    assert config["key_control.scale"] == "data"  # not in the run's config: the default
