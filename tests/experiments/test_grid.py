"""Grid files -> runs: product order, stable unique ids, validation before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkgeom.config import make_config
from qkgeom.errors import QKGeomError
from qkgeom.experiments import E1_PRESETS, E3_PRESETS, Grid, e3_arm, experiment, load_grid
from qkgeom.experiments.grid import _id_value, _labels

e1_grid = experiment("e1").grid
e3_grid = experiment("e3").grid

E1_YAML = """\
name: e1-test
preset: smoke
base: {steps: 30, model.n_head: 2}
axes:
  model.n_layer: [1, 2]
  model.qk_init: [normal, orthogonal, tied]
  seed: [0, 1]
"""


def test_product_size_order_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(E1_YAML)
    specs = load_grid(path).expand()
    assert len(specs) == 2 * 3 * 2
    # Cartesian product in the order given; the last axis varies fastest.
    assert [s.run_id for s in specs[:4]] == [
        "n_layer=1,qk_init=normal,seed=0", "n_layer=1,qk_init=normal,seed=1",
        "n_layer=1,qk_init=orthogonal,seed=0", "n_layer=1,qk_init=orthogonal,seed=1"]
    assert specs[-1].run_id == "n_layer=2,qk_init=tied,seed=1"
    assert len({s.run_id for s in specs}) == len(specs)
    assert len({s.config_hash for s in specs}) == len(specs)
    for s in specs:
        assert s.config.model.n_layer == s.axes["model.n_layer"]
        assert s.config.model.qk_init == s.axes["model.qk_init"]
        assert s.config.seed == s.axes["seed"]
        assert s.config.steps == 30 and s.config.model.n_head == 2  # base applied
        assert s.config.model.n_embd == make_config("smoke").model.n_embd  # preset kept


def test_ids_are_stable_across_calls_and_spellings(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(E1_YAML)
    a = [(s.run_id, s.config_hash) for s in load_grid(path).expand()]
    b = [(s.run_id, s.config_hash) for s in load_grid(path).expand()]
    nested = Grid.from_dict({"name": "e1-test", "preset": "smoke",
                             "base": {"steps": 30, "model": {"n_head": 2}},
                             "axes": {"model": {"n_layer": [1, 2],
                                                "qk_init": ["normal", "orthogonal", "tied"]},
                                      "seed": [0, 1]}})
    assert a == b == [(s.run_id, s.config_hash) for s in nested.expand()]
    assert load_grid(path).to_dict() == nested.to_dict()


def test_values_are_validated_and_printed_after_coercion(tmp_path: Path) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text("preset: smoke\naxes:\n  lr: [1e-3, 3.0e-3]\n  model.dropout: [0, 0.1]\n")
    grid = load_grid(path)
    assert grid.name == "lr"  # defaults to the file's stem
    specs = grid.expand()
    assert specs[0].config.lr == 0.001 and isinstance(specs[0].config.lr, float)
    assert [s.run_id for s in specs] == ["lr=0.001,dropout=0.0", "lr=0.001,dropout=0.1",
                                         "lr=0.003,dropout=0.0", "lr=0.003,dropout=0.1"]


def test_ids_are_filesystem_safe() -> None:
    grid = Grid.from_dict({"preset": "smoke", "axes": {
        "data": ["/data/wiki text/a", "x" * 80], "model.bias": [True, False]}})
    ids = [s.run_id for s in grid.expand()]
    assert ids[0] == "data=_data_wiki_text_a,bias=true"
    for run_id in ids:
        assert "/" not in run_id and " " not in run_id and len(run_id) < 80
    assert _id_value("x" * 80) != _id_value("x" * 81)  # shortened values keep a hash
    assert _labels(["model.dropout", "dropout", "seed"]) == {
        "model.dropout": "model.dropout", "dropout": "dropout", "seed": "seed"}


def test_no_axes_is_one_run() -> None:
    specs = Grid.from_dict({"preset": "smoke", "base": {"steps": 10}}).expand()
    assert [s.run_id for s in specs] == ["base"] and specs[0].config.steps == 10


@pytest.mark.parametrize("text, words", [
    ("- a\n- b\n", "must be a mapping"),
    ("preset: smoke\naxis: {seed: [0]}\n", "unknown grid key 'axis'"),
    ("preset: tiny\naxes: {seed: [0]}\n", "unknown preset 'tiny'"),
    ("preset: smoke\naxes: {model.depth: [2]}\n", "axis 'model.depth': unknown config key"),
    ("preset: smoke\naxes: {model.qk_init: [normal, xavier]}\n", "unknown qk_init 'xavier'"),
    ("preset: smoke\naxes: {seed: []}\n", "axis 'seed' is empty"),
    ("preset: smoke\naxes: {seed: 3}\n", "must be a list"),
    ("preset: smoke\naxes: {seed: [0, 1, 0]}\n", "lists 0 twice"),
    ("preset: smoke\naxes: {model.n_layer: [2, 2.0]}\n", "same run id 'n_layer=2'"),
    ("preset: smoke\naxes: {seed: [0]}\naxes: {seed: [1]}\n", "key 'axes' is given twice"),
    ("preset: smoke\nbase: {stepz: 3}\naxes: {seed: [0]}\n", "base: unknown config key 'stepz'"),
    ("preset: smoke\nbase: {steps: 8, warmup_steps: 0}\n", "probe_every (10) is larger"),
    ("preset: smoke\nbase: {model.n_head: 2, model: {n_head: 4}}\n", "set twice"),
    ("preset: smoke\naxes: {threads: [1, 2]}\n", "set by the sweep runner"),
    ("preset: smoke\naxes: {seed: [[0]]}\n", "must be scalars"),
    ("preset: smoke\naxes: [seed]\n", "axes must be a mapping"),
    ("preset: smoke\naxes: {seed: [0\n", "not valid YAML"),
])
def test_bad_grids_fail_in_one_line(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(QKGeomError) as info:
        load_grid(path)
    message = str(info.value)
    assert words in message and str(path) in message
    assert "\n" not in message


def test_missing_grid_file(tmp_path: Path) -> None:
    with pytest.raises(QKGeomError, match="grid file not found"):
        load_grid(tmp_path / "nope.yaml")


def test_e1_grids_have_the_papers_structure() -> None:
    inits = {"normal", "orthogonal", "tied"}
    smoke = e1_grid("smoke")
    assert len(smoke.expand()) == 6 and set(smoke.axes["model.qk_init"]) == inits
    demo = e1_grid("demo").expand()
    assert len(demo) == 18
    assert {s.config.model.n_layer for s in demo} == {4, 6, 8}
    assert len({s.config.seed for s in demo}) >= 2
    cfg = demo[0].config
    assert cfg.steps // cfg.probe_every >= 10  # probed at least ~10 times per run
    paper = e1_grid("paper", data="/data/wikitext-103").expand()
    assert len(paper) == 36 and {s.config.seed for s in paper} == set(range(36))
    assert paper[0].config.model.n_embd == make_config("paper").model.n_embd
    assert paper[0].config.data == "/data/wikitext-103"
    cuda = e1_grid("demo", overrides={"device": "cuda"}).expand()
    assert all(s.config.device == "cuda" for s in cuda)
    assert set(E1_PRESETS) == {"smoke", "demo", "lab", "paper", "ladder"}


def test_e1_grid_errors() -> None:
    with pytest.raises(QKGeomError, match="WikiText-103"):
        e1_grid("paper")
    with pytest.raises(QKGeomError, match="unknown E1 preset"):
        e1_grid("huge")
    with pytest.raises(QKGeomError, match="unknown config key"):
        e1_grid("smoke", overrides={"model.depth": 3})


ARMS_YAML = """\
name: arms
preset: smoke
base: {steps: 20}
axes: {seed: [0, 1]}
arms:
  - {name: none, set: {key_control.mode: none, key_control.record: true}}
  - name: shrink-0.5
    set: {key_control: {mode: shrink, dose: 0.5}}
    reference: none
  - {name: hold, set: {key_control.mode: hold}}
"""


def test_arms_cross_the_axes_with_ids_and_dependencies(tmp_path: Path) -> None:
    path = tmp_path / "arms.yaml"
    path.write_text(ARMS_YAML)
    grid = load_grid(path)
    specs = grid.expand()
    assert [s.run_id for s in specs] == [
        "seed=0,arm=none", "seed=0,arm=shrink-0.5", "seed=0,arm=hold",
        "seed=1,arm=none", "seed=1,arm=shrink-0.5", "seed=1,arm=hold"]
    by_id = {s.run_id: s for s in specs}
    dep = by_id["seed=1,arm=shrink-0.5"]
    assert dep.depends_on == "seed=1,arm=none" and dep.axes == {"seed": 1, "arm": "shrink-0.5"}
    assert dep.config.key_control.reference == "seed=1,arm=none"  # the sibling folder
    assert dep.config.key_control.mode == "shrink" and dep.config.key_control.dose == 0.5
    assert dep.config.seed == 1 and dep.config.steps == 20
    assert by_id["seed=0,arm=none"].config.key_control.record
    assert by_id["seed=0,arm=hold"].depends_on == "" and by_id["seed=0,arm=none"].depends_on == ""
    again = Grid.from_dict(grid.to_dict())  # the normalised record round-trips
    assert again == grid and [s.run_id for s in again.expand()] == [s.run_id for s in specs]
    assert "arms" not in Grid.from_dict({"preset": "smoke", "axes": {"seed": [0]}}).to_dict()


def test_arms_without_axes_are_named_by_the_arm_alone() -> None:
    grid = Grid.from_dict({"preset": "smoke", "arms": [
        {"name": "a", "set": {"seed": 3}}, {"name": "b", "set": {"seed": 4}}]})
    assert [(s.run_id, s.config.seed) for s in grid.expand()] == [("arm=a", 3), ("arm=b", 4)]


NONE_ARM = "{name: none, set: {key_control.mode: none, key_control.record: true}}"


@pytest.mark.parametrize("arms, words", [
    ("[]", "arms must be a non-empty list"),
    ("[3]", "each arm must be a mapping"),
    ("[{name: a, sets: {}}]", "unknown arm key 'sets'"),
    ("[{set: {}}]", "arm names must be non-empty"),
    ("[{name: 'a b'}]", "arm names must be non-empty"),
    ("[{name: a}, {name: a}]", "arm 'a' is given twice"),
    ("[{name: a, set: 3}]", "set must be a mapping"),
    ("[{name: a, set: {seed: 2}}]", "arm 'a' sets 'seed', which an axis sweeps"),
    ("[{name: a, set: {stepz: 2}}]", "arm 'a', run {'seed': 0}: unknown config key 'stepz'"),
    ("[{name: a, reference: b}]", "references 'b', which is not an arm"),
    ("[{name: a, reference: a}]", "form a cycle (a -> a)"),
    ("[{name: a, reference: b}, {name: b, reference: a}]", "form a cycle"),
    (f"[{NONE_ARM}, {{name: h, set: {{key_control.mode: hold, key_control.scale: frobenius}}, "
     "reference: none}]", "hold with the frobenius rule reads nothing"),
    ("[{name: n, set: {key_control.mode: none}}, "
     "{name: s, set: {key_control.mode: shrink}, reference: n}]", "does not record its key PR"),
    (f"[{NONE_ARM}, {{name: s, set: {{key_control.mode: shrink, "
     "key_control.reference: x}, reference: none}]", "give one of them"),
    ("[{name: none, set: {key_control.mode: none, key_control.record: true, steps: 10}}, "
     "{name: s, set: {key_control.mode: shrink}, reference: none}]", "only 10"),
])
def test_bad_arms_fail_in_one_line(tmp_path: Path, arms: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"preset: smoke\naxes: {{seed: [0]}}\narms: {arms}\n")
    with pytest.raises(QKGeomError) as info:
        load_grid(path)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_e3_grids_are_the_protocols_arms() -> None:
    core = ["none", "sham-token-data", "hold-token-data", "shrink-0.5-token-data"]
    smoke = e3_grid("smoke")
    assert [a.name for a in smoke.arms] == core
    assert len(smoke.expand()) == 8
    demo = e3_grid("demo")
    assert [a.name for a in demo.arms] == core
    specs = demo.expand()
    assert len(specs) == 80 and {s.config.seed for s in specs} == set(range(20))
    cfg = specs[0].config
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.qk_init) == (4, 128, "normal")
    assert (cfg.steps, cfg.probe_every, cfg.eval_every) == (400, 25, 100)
    kc = {s.axes["arm"]: s.config.key_control for s in specs if s.config.seed == 2}
    assert kc["none"].mode == "none" and kc["none"].record
    sham = kc["sham-token-data"]
    assert (sham.mode, sham.level, sham.scale, sham.dose) == ("sham", "token", "data", 1)
    shrink = kc["shrink-0.5-token-data"]
    assert (shrink.mode, shrink.dose, shrink.level, shrink.scale) == ("shrink", 0.5, "token",
                                                                      "data")
    assert shrink.reference == "seed=2,arm=none" and shrink.ramp_steps == -1
    assert kc["hold-token-data"].reference == "seed=2,arm=none"  # its key spread: none's
    assert all(k.arm == a for a, k in kc.items())  # one naming rule, both ways
    deps = {s.run_id: s.depends_on for s in specs if s.depends_on}
    assert set(deps) == {f"seed={k},arm={a}" for k in range(20) for a in core[1:]}
    lab = e3_grid("lab").expand()
    assert len(lab) == 32 and lab[0].config.steps == 2000
    paper = e3_grid("paper", data="/data/wikitext-103")
    assert len(paper.expand()) == 160 and [a.name for a in paper.arms] == [
        *core, "shrink-0.75-token-data", "shrink-0.25-token-data", "hold-weight-frobenius",
        "shrink-0.5-weight-frobenius"]
    assert set(E3_PRESETS) == {"smoke", "demo", "lab", "paper", "w64"}
    with pytest.raises(QKGeomError, match="unknown E3 arm"):
        e3_arm("shrink-half-token-data")


def test_e3_at_width_64_is_the_demos_protocol_on_three_arms() -> None:
    """Protocol 2: `reproduce e3 --preset w64` = the E3 demo's protocol (400 steps, probes
    every 25, 20 seeds) at width 64 (4 heads of dimension 16, 4 layers, context 64) on
    none, shrink-0.5 and hold at the token level with the data rule."""
    grid = e3_grid("w64")
    assert [a.name for a in grid.arms] == ["none", "shrink-0.5-token-data", "hold-token-data"]
    specs = grid.expand()
    assert len(specs) == 60 and {s.config.seed for s in specs} == set(range(20))
    demo = e3_grid("demo").expand()[0].config
    for s in specs:
        m = s.config.model
        assert (m.n_embd, m.n_head, m.n_embd // m.n_head, m.n_layer, m.block_size) == (
            64, 4, 16, 4, 64)
        assert m.qk_init == "normal"
        assert (s.config.steps, s.config.probe_every, s.config.eval_every,
                s.config.batch_size, s.config.lr, s.config.warmup_steps) == (
            demo.steps, demo.probe_every, demo.eval_every, demo.batch_size, demo.lr,
            demo.warmup_steps) == (400, 25, 100, 16, demo.lr, 30)
    kc = {s.axes["arm"]: s.config.key_control for s in specs if s.config.seed == 3}
    assert (kc["shrink-0.5-token-data"].dose, kc["shrink-0.5-token-data"].level) == (0.5,
                                                                                    "token")
    assert kc["hold-token-data"].reference == "seed=3,arm=none"
    assert specs[0].axes["arm"] == "none"  # the baseline of each seed trains first


def test_a_grid_records_the_experiment_it_declares() -> None:
    """``reproduce`` grids name their experiment (the report reads it back from
    sweep.json); a grid file may declare one of them, and nothing else."""
    assert [experiment(n).grid("smoke").to_dict()["experiment"] for n in ("e1", "e3")] == [
        "e1", "e3"]
    assert "experiment" not in Grid.from_dict({"preset": "smoke"}).to_dict()
    with pytest.raises(QKGeomError, match="experiment must be one of e1, e3, e4"):
        Grid.from_dict({"preset": "smoke", "experiment": "e2"})


def test_e1_runs_each_have_their_own_seed() -> None:
    """distinct_seeds: replicate r of cell i trains with seed r + i × replicates, so no two
    runs share a data order or an initial weight."""
    specs = e1_grid("demo").expand()
    seeds = [s.config.seed for s in specs]
    assert sorted(seeds) == list(range(18))
    assert specs[0].run_id == "n_layer=4,qk_init=normal,seed=0"
    assert specs[1].run_id == "n_layer=4,qk_init=normal,seed=1"
    assert specs[2].run_id == "n_layer=4,qk_init=orthogonal,seed=2"
    assert specs[-1].run_id == "n_layer=8,qk_init=tied,seed=17"
    assert sorted(s.config.seed for s in e1_grid("lab").expand()) == list(range(27))
    assert Grid.from_dict(e1_grid("demo").to_dict()).expand()[5].config.seed == 5  # round trip
    with pytest.raises(QKGeomError, match="distinct_seeds needs a seed axis"):
        Grid.from_dict({"axes": {"model.n_layer": [1]}, "distinct_seeds": True})
    with pytest.raises(QKGeomError, match="WikiText-103"):
        e3_grid("paper")


def test_reproduce_runs_the_experiments_grid_and_records_its_name(sample_data: Path,
                                                                  tmp_path: Path) -> None:
    """The Python API's ``reproduce`` trains the experiment's grid (here E3 at smoke size,
    cut to 8 steps) into a sweep folder whose sweep.json names the experiment, so the
    report is E3's without looking at the runs."""
    import json

    from qkgeom.analysis import claims_table
    from qkgeom.experiments import SweepSummary, reproduce

    short = {"steps": 8, "warmup_steps": 2, "probe_every": 4, "eval_every": 4,
             "checkpoint_every": 8, "log_every": 4}
    summary = reproduce("e3", "smoke", tmp_path / "e3", str(sample_data), overrides=short,
                        workers=1, progress=False)
    assert isinstance(summary, SweepSummary) and summary.complete
    assert summary.counts["done"] == 8
    record = json.loads((tmp_path / "e3" / "sweep.json").read_text())
    assert record["grid"]["experiment"] == "e3"
    assert claims_table(tmp_path / "e3")["claim_id"].iloc[0] == "E3.1"


@pytest.mark.parametrize("device, workers, threads", [("cuda", None, None), ("cpu", 3, 1)])
def test_experiment_run_leaves_cuda_workers_to_the_runner(monkeypatch: pytest.MonkeyPatch,
                                                          device: str, workers: int | None,
                                                          threads: int | None) -> None:
    """``Experiment.run`` with ``workers=None``: on a CPU one single-threaded run per core
    (here 3 cores), on CUDA nothing decided, so the runner's ``runs_per_gpu`` applies."""
    import importlib

    import qkgeom.config
    import qkgeom.experiments.runner as runner

    # the package's experiment() function hides the module of the same name
    experiment_module = importlib.import_module("qkgeom.experiments.experiment")

    seen: dict[str, object] = {}
    monkeypatch.setattr(qkgeom.config, "detect_device", lambda: device)
    monkeypatch.setattr(runner, "available_cpus", lambda: 3)
    monkeypatch.setattr(experiment_module, "available_cpus", lambda: 3)
    monkeypatch.setattr(experiment_module, "run_sweep",
                        lambda grid, out, **kwargs: seen.update(kwargs))
    experiment("e1").run(e1_grid("smoke"), "unused", progress=False)
    assert (seen["workers"], seen["threads_per_run"]) == (workers, threads)


SIZES_YAML = """\
preset: smoke
base: {steps: 20}
axes: {seed: [0, 1]}
sizes:
  - {name: narrow, set: {model.n_embd: 16, model.n_head: 2}}
  - {name: wide-ctx16, set: {model: {n_embd: 64, n_head: 4, block_size: 16}, batch_size: 4}}
arms:
  - {name: none, set: {key_control.mode: none, key_control.record: true}}
  - {name: shrink, set: {key_control.mode: shrink, key_control.dose: 0.5}, reference: none}
"""


def test_sizes_cross_outermost_and_arms_pair_within_a_size(tmp_path: Path) -> None:
    path = tmp_path / "sizes.yaml"
    path.write_text(SIZES_YAML)
    grid = load_grid(path)
    specs = grid.expand()
    assert grid.size == len(specs) == 2 * 2 * 2
    assert [s.run_id for s in specs[:4]] == [
        "size=narrow,seed=0,arm=none", "size=narrow,seed=0,arm=shrink",
        "size=narrow,seed=1,arm=none", "size=narrow,seed=1,arm=shrink"]
    by_id = {s.run_id: s for s in specs}
    wide = by_id["size=wide-ctx16,seed=1,arm=shrink"]
    assert wide.axes == {"size": "wide-ctx16", "seed": 1, "arm": "shrink"}
    assert wide.depends_on == "size=wide-ctx16,seed=1,arm=none"  # its own size's run
    m = wide.config.model
    assert (m.n_embd, m.n_head, m.block_size, wide.config.batch_size) == (64, 4, 16, 4)
    narrow = by_id["size=narrow,seed=1,arm=none"].config
    assert (narrow.model.n_embd, narrow.model.n_head, narrow.steps) == (16, 2, 20)
    assert narrow.model.block_size == make_config("smoke").model.block_size
    again = Grid.from_dict(grid.to_dict())  # the record round-trips
    assert again == grid and [s.run_id for s in again.expand()] == [s.run_id for s in specs]
    assert "sizes" not in Grid.from_dict({"preset": "smoke", "axes": {"seed": [0]}}).to_dict()


def test_distinct_seeds_count_the_size_as_an_axis() -> None:
    grid = Grid.from_dict({"preset": "smoke", "distinct_seeds": True,
                           "axes": {"model.qk_init": ["normal", "tied"], "seed": [0, 1]},
                           "sizes": [{"name": "a", "set": {"model.n_embd": 16}},
                                     {"name": "b", "set": {"model.n_embd": 32}}]})
    seeds = [s.config.seed for s in grid.expand()]
    assert seeds == list(range(8))  # every run its own seed, none shared across sizes


@pytest.mark.parametrize("sizes, words", [
    ("[]", "sizes must be a non-empty list"),
    ("[{name: a, sett: {}}]", "each size must be a mapping with keys name, set"),
    ("[{name: 'a/b'}]", "size names must be non-empty"),
    ("[{name: a}, {name: a}]", "size 'a' is given twice"),
    ("[{name: a, set: {seed: 3}}]", "size 'a' sets 'seed', which an axis sweeps"),
    ("[{name: a, set: {key_control.mode: hold}}]", "which an arm sets"),
    ("[{name: a, set: {model.n_embd: 33}}]", "size 'a':"),
])
def test_bad_sizes_fail_in_one_line(tmp_path: Path, sizes: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("preset: smoke\naxes: {seed: [0]}\n"
                    "arms: [{name: none, set: {key_control.mode: none}}]\n"
                    f"sizes: {sizes}\n")
    with pytest.raises(QKGeomError) as info:
        load_grid(path)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_stability_alert_presets_train_several_sizes_at_equal_tokens() -> None:
    """calibrate: 4 sizes × 3 rates × 3 seeds of `none`; transfer: 2 held-out sizes; every
    size at 1 024 tokens per step and the same steps."""
    stab = experiment("stability")
    for preset, n_sizes, runs in (("calibrate", 4, 36), ("transfer", 2, 18)):
        specs = stab.grid(preset).expand()
        assert len(specs) == runs
        assert len({s.axes["size"] for s in specs}) == n_sizes
        assert {s.axes["arm"] for s in specs} == {"none"}
        assert {s.config.batch_size * s.config.model.block_size for s in specs} == {1024}
        assert {(s.config.steps, s.config.warmup_steps, s.config.probe_every)
                for s in specs} == {(200, 20, 5)}
        assert {s.config.lr for s in specs} == {3e-3, 3e-2, 1e-1}
    cal = {s.axes["size"]: s.config.model for s in stab.grid("calibrate").expand()}
    assert sorted((m.n_embd // m.n_head, m.block_size) for m in cal.values()) == [
        (16, 64), (32, 64), (32, 256), (64, 64)]
    held = {s.axes["size"]: s.config.model for s in stab.grid("transfer").expand()}
    assert not {(m.n_layer, m.n_embd, m.block_size) for m in held.values()} & {
        (m.n_layer, m.n_embd, m.block_size) for m in cal.values()}


def test_stability_presets_are_the_protocols_sweeps() -> None:
    """docs/stability.md#design: the demo's 4 rates × 5 seeds × 9 arms, the lab's 7 × 5 × 7
    (no hold, no closed loop), the smoke's 2 × 1 × 9; every arm the same steps."""
    from qkgeom.experiments.stability import LAB_ARMS, REMEDIES, STABILITY_PRESETS

    sizes = {name: len(p.axes["lr"]) * len(p.seeds) * len(p.arms)
             for name, p in STABILITY_PRESETS.items()}
    assert sizes == {"smoke": 18, "demo": 180, "lab": 245, "calibrate": 9, "transfer": 9}
    assert STABILITY_PRESETS["demo"].axes["lr"] == [3e-4, 3e-3, 3e-2, 3e-1]
    assert STABILITY_PRESETS["lab"].axes["lr"] == [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
    assert set(REMEDIES) - set(LAB_ARMS) == {"hold", "entropy_target"}
    assert REMEDIES["qk_clip"] == {"model.qk_clip_threshold": 100.0,
                                   "model.qk_clip_alpha": 0.5}
    assert REMEDIES["sigma_reparam_all"] == {"model.sigma_reparam": "all"}
    assert REMEDIES["z_loss"] == {"z_loss": 1.0e-4}
    assert REMEDIES["logit_softcap"] == {"model.logit_softcap": 50.0}


def test_the_old_sigma_reparam_arm_is_an_alias_with_a_warning() -> None:
    stab = experiment("stability")
    with pytest.warns(FutureWarning, match="'sigma_reparam' is now 'sigma_reparam_qk'"):
        arm = stab.arm("sigma_reparam")
    assert arm == {"name": "sigma_reparam_qk", "set": {"model.sigma_reparam": "qk"}}
    with pytest.raises(QKGeomError, match="unknown stability remedy 'sigma'"):
        stab.arm("sigma")
