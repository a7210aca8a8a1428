"""Attack 5: bad input fuzzing (hypothesis). Every input gives a valid result or a one-line
error with exit code 2; no traceback, and nothing half-written in the output folder.

Config validation is fuzzed in-process (``qkgeom.cli.main`` with the trainer stubbed out
once the input is accepted, so no run trains); a handful of real subprocesses check the same
path end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from fault_helpers import clean_error, cli, figure, in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
TALLY: dict[str, list[int]] = {}  # attack -> [tried, handled cleanly]


def _count(name: str, ok: bool) -> None:
    tally = TALLY.setdefault(name, [0, 0])
    tally[0] += 1
    tally[1] += int(ok)


class _Accepted(Exception):
    """Raised by the stubbed trainer / sweep: the input passed validation."""


@pytest.fixture
def stub_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import qkgeom.experiments
    import qkgeom.launch

    def accepted(*_a, **_k):
        raise _Accepted

    monkeypatch.setattr(qkgeom.launch, "train", accepted)  # what the CLI trains through
    monkeypatch.setattr(qkgeom.experiments, "run_sweep", accepted)


def _outcome(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[bool, bool]:
    """(accepted, clean): accepted = reached the (stubbed) work."""
    try:
        code, _, err = in_process(args, capsys)
    except _Accepted:
        return True, True
    return False, clean_error(code, err)


# --- data prepare ----------------------------------------------------------------------------

ENCODINGS = st.sampled_from(["utf-8", "latin-1", "utf-16", "cp1252", "shift_jis"])
TEXTS = st.text(min_size=0, max_size=300)
CONTENTS = st.one_of(
    st.binary(max_size=2000),
    st.just(b""),
    st.lists(st.tuples(TEXTS, ENCODINGS), min_size=1, max_size=4).map(
        lambda parts: b"".join(t.encode(e, "replace") for t, e in parts)),
    st.integers(1, 3).map(lambda n: ("x" * 700_000 * n).encode()),  # one huge line
    TEXTS.map(lambda t: (t * 50).encode("utf-8", "surrogatepass")),
)


@FUZZ
@given(content=CONTENTS)
def test_data_prepare_fuzz(content: bytes, tmp_path_factory: pytest.TempPathFactory,
                           capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path_factory.mktemp("prep")
    src = root / "corpus.txt"
    src.write_bytes(content)
    out = root / "out"
    code, _, err = in_process(["data", "prepare", "--source", "text", "--dir", str(out),
                               "--path", str(src)], capsys)
    if code == 0:
        from qkgeom.data import load_prepared

        load_prepared(out)  # a valid folder
        ok = True
    else:
        ok = clean_error(code, err) and (not out.exists() or not any(out.iterdir()))
    _count("data prepare", ok)
    shutil.rmtree(root)
    assert ok, (content[:80], code, err)


# --- train config values ---------------------------------------------------------------------

KEYS = st.sampled_from([
    "steps", "batch_size", "lr", "warmup_steps", "probe_every", "eval_every", "log_every",
    "checkpoint_every", "keep_checkpoints", "key_control.dose", "key_control.scale",
    "key_control.reference", "key_control.record", "key_control.ramp_steps",
    "key_control.mode", "key_control.scope", "key_control", "precision", "seed", "grad_clip", "weight_decay", "min_lr_ratio",
    "beta1", "beta2", "reference_step", "threads", "model.n_layer", "model.n_head",
    "model.n_embd", "model.block_size", "model.dropout", "model.qk_init", "model.bias",
    "model", "nonsense", "model.depth", "data", "device"])
VALUES = st.one_of(
    st.integers(-3, 3), st.integers(-10**12, 10**12), st.sampled_from([0, 31, 1000, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["normal", "xavier", "hold", "shrink", "grow", "", "1e-3", "nan", "{",
                     "[1, 2]", "cuda:9", "fp8", "cpu"]),
    st.text(max_size=12), st.lists(st.integers(), max_size=2))


def _set(key: str, value: object) -> str:
    raw = value if isinstance(value, str) else json.dumps(value)
    return f"{key}={raw}"


@FUZZ
@given(pairs=st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=3))
def test_train_set_fuzz(pairs: list[tuple[str, object]], sample_data: Path,
                        tmp_path_factory: pytest.TempPathFactory,
                        capsys: pytest.CaptureFixture[str], stub_work: None) -> None:
    out = tmp_path_factory.mktemp("train") / "run"
    args = ["train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
            "--quiet"]
    for key, value in pairs:
        args += ["--set", _set(key, value)]
    accepted, ok = _outcome(args, capsys)
    ok = ok and (accepted or not out.exists())
    _count("train --set", ok)
    assert ok, args


CONFIG_FILES = st.one_of(
    st.dictionaries(KEYS, VALUES, max_size=3).map(yaml.safe_dump),
    st.sampled_from(["- 1\n- 2\n", "just a string\n", "42\n", "", "{a: [\n", "\t: :\n",
                     "model: 3\n", "model: {n_embd: 30, n_head: 4}\n", "~\n"]),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
)


@FUZZ
@given(text=CONFIG_FILES)
def test_train_config_file_fuzz(text: str, sample_data: Path,
                                tmp_path_factory: pytest.TempPathFactory,
                                capsys: pytest.CaptureFixture[str], stub_work: None) -> None:
    root = tmp_path_factory.mktemp("cfg")
    cfg = root / "cfg.yaml"
    cfg.write_text(text, encoding="latin-1", errors="replace")
    out = root / "run"
    accepted, ok = _outcome(["train", "--preset", "smoke", "--data", str(sample_data),
                             "--out", str(out), "--quiet", "--config", str(cfg)], capsys)
    ok = ok and (accepted or not out.exists())
    _count("train --config", ok)
    assert ok, text


GRIDS = st.one_of(
    st.fixed_dictionaries({
        "name": st.one_of(st.just("g"), st.text(max_size=5), st.integers()),
        "preset": st.sampled_from(["smoke", "huge", 3]),
        "base": st.one_of(st.dictionaries(KEYS, VALUES, max_size=2), st.just([1])),
        "axes": st.one_of(st.dictionaries(KEYS, st.one_of(st.lists(VALUES, max_size=3), VALUES),
                                          max_size=2), st.just("seed")),
    }, optional={"extra": st.integers()}).map(lambda d: yaml.safe_dump(d)),
    st.sampled_from(["- a\n", "", "name: [\n", "axes: {seed: [0, 0]}\n",
                     "axes: {lr: []}\n", "axes: {model.n_head: [3]}\n"]),
)


@FUZZ
@given(text=GRIDS)
def test_sweep_grid_fuzz(text: str, sample_data: Path, tmp_path_factory: pytest.TempPathFactory,
                         capsys: pytest.CaptureFixture[str], stub_work: None) -> None:
    root = tmp_path_factory.mktemp("grid")
    grid = root / "grid.yaml"
    grid.write_text(text)
    out = root / "sweep"
    accepted, ok = _outcome(["sweep", "run", str(grid), "--out", str(out), "--quiet"], capsys)
    ok = ok and (accepted or not out.exists())
    _count("sweep run grid", ok)
    assert ok, text


# --- the Python API --------------------------------------------------------------------------


def _field_values() -> st.SearchStrategy:
    from qkgeom.config import GPTConfig, KeyControlConfig, TrainConfig

    fields = [("", f.name) for f in dataclasses.fields(TrainConfig)] + \
             [("model.", f.name) for f in dataclasses.fields(GPTConfig)] + \
             [("key_control.", f.name) for f in dataclasses.fields(KeyControlConfig)]
    return st.tuples(st.sampled_from(fields), VALUES)


@FUZZ
@given(change=_field_values(), overrides=st.dictionaries(KEYS, VALUES, max_size=2))
def test_python_api_fuzz(change: tuple[tuple[str, str], object], overrides: dict,
                         sample_data: Path, tmp_path_factory: pytest.TempPathFactory,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    import qkgeom
    import qkgeom.training.trainer as trainer
    from qkgeom.errors import QKGeomError

    nested: dict = {}
    for key, value in overrides.items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[parts[-1]] = value
    try:
        qkgeom.make_config("smoke", nested)
        ok = True
    except QKGeomError:
        ok = True
    except Exception:  # anything else is a fault
        ok = False
    _count("make_config", ok)
    assert ok, nested
    # A config built in Python with one ill-typed or impossible field: train() must refuse
    # it before writing anything (GPT construction stubbed: valid configs stop there).
    (prefix, name), value = change
    cfg = qkgeom.make_config("smoke", {"data": str(sample_data)})
    if prefix:
        section = prefix.rstrip(".")
        inner = dataclasses.replace(getattr(cfg, section), **{name: value})
        cfg = dataclasses.replace(cfg, **{section: inner})
    else:
        cfg = dataclasses.replace(cfg, **{name: value})
    out = tmp_path_factory.mktemp("api") / "run"

    def accepted(*_a, **_k):
        raise _Accepted

    monkeypatch.setattr(trainer, "GPT", accepted)
    try:
        qkgeom.train(cfg, out)
        ok = False
    except _Accepted:
        ok = True
        shutil.rmtree(out, ignore_errors=True)
    except QKGeomError:
        ok = not out.exists()
    except Exception:
        ok = False
    _count("qkgeom.train(config)", ok)
    assert ok, (prefix + name, value)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["random bytes corpus", "grid not a mapping",
                                  "config n_embd % n_head", "unknown init", "shrink_to 0",
                                  "probe_every > steps"])
def test_fuzz_cases_in_real_subprocesses(case: str, sample_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if case == "random bytes corpus":
        src = tmp_path / "c.txt"
        src.write_bytes(bytes(range(256)) * 3)
        res = cli("data", "prepare", "--source", "text", "--dir", str(out), "--path", str(src))
    elif case == "grid not a mapping":
        grid = tmp_path / "g.yaml"
        grid.write_text("- seed\n- 1\n")
        res = cli("sweep", "run", str(grid), "--out", str(out))
    else:
        flags = {"config n_embd % n_head": ["--n-embd", "30", "--n-head", "4"],
                 "unknown init": ["--qk-init", "xavier"],
                 "shrink_to 0": ["--key-control", "shrink", "--shrink-to", "0"],
                 "probe_every > steps": ["--steps", "5", "--probe-every", "10"]}[case]
        res = cli("train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
                  "--quiet", *flags)
    ok = clean_error(res.returncode, res.stderr) and not out.exists()
    _count("real subprocesses", ok)
    assert ok, (case, res.returncode, res.stderr)


def test_zz_fuzz_figure() -> None:
    tried = sum(t for t, _ in TALLY.values())
    clean = sum(c for _, c in TALLY.values())
    figure("fuzzing", f"inputs handled cleanly {clean}/{tried} ("
           + ", ".join(f"{k} {c}/{t}" for k, (t, c) in TALLY.items()) + ")")
