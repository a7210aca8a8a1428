"""Attack 5: bad input fuzzing (hypothesis). Every input gives a valid result or a one-line
error with exit code 2; no traceback, and nothing half-written in the output folder.

Config validation is fuzzed in-process (``qkgeom.cli.main`` and the Python API). An input
that is accepted really runs: the real trainer builds the run (data, model, run folder),
probes step 0 and trains one step, then a callback stops it (the CLI exits 130, as for
Ctrl-C) and its folder must be a valid run folder, recorded ``interrupted``; an accepted sweep grid goes through the
real sweep runner with its runs trained in this process (the same ``run_one`` the workers
call), stopped the same way in its first run. A handful of real subprocesses check the same
path end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fault_helpers import clean_error, cli, in_process, tally
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qkgeom.io import read_json
from qkgeom.training import Callback, TrainContext

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


class _FirstStepDone(KeyboardInterrupt):
    """Raised after an accepted run's first update: it ran; stop it as Ctrl-C would."""


class _StopAfterFirstStep(Callback):
    def __init__(self) -> None:
        self.fired = 0

    def on_step_end(self, ctx: TrainContext) -> None:
        self.fired += 1
        raise _FirstStepDone


class _InProcessBackend:
    """The sweep backend protocol with each run trained by ``run_one`` in this process."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []

    def submit(self, run_dir: Path, config_dict: dict[str, Any], threads: int,
               retry_failed: bool) -> None:
        from qkgeom.experiments.worker import run_one

        self.done.append(run_one(str(run_dir), config_dict, threads, retry_failed=retry_failed))

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        done, self.done = self.done, []
        return done

    def cancel(self, signum: int = 2) -> None: ...

    def close(self) -> None: ...


@pytest.fixture
def first_step(monkeypatch: pytest.MonkeyPatch, sample_data: Path,
               tmp_path_factory: pytest.TempPathFactory) -> _StopAfterFirstStep:
    """Accepted inputs run for real up to their first update (see the module doc). The
    test process keeps its torch thread count and RNG: a fuzzed ``threads`` is recorded,
    not applied (1000 OpenMP threads on a test machine would only slow the suite). A grid
    without ``data`` trains on the default corpus: the session's prepared sample, in a
    cache of the test's own (never the user's)."""
    import qkgeom.experiments.runner as runner
    import qkgeom.launch

    cache = tmp_path_factory.mktemp("qkgeom-cache")
    shutil.copytree(sample_data, cache / "data" / "sample")
    monkeypatch.setenv("QKGEOM_CACHE", str(cache))

    stopper = _StopAfterFirstStep()
    callbacks_for, make_backend = qkgeom.launch.callbacks_for, runner.make_backend

    def with_stopper(cfg, out_dir=None):
        return [*callbacks_for(cfg, out_dir), stopper]

    def in_process_backend(name, address=None, retries=0, **placement):
        make_backend(name, address, retries, **placement).close()  # its argument checks
        return _InProcessBackend()

    monkeypatch.setattr(qkgeom.launch, "callbacks_for", with_stopper)
    monkeypatch.setattr(runner, "make_backend", in_process_backend)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with torch.random.fork_rng():
        yield stopper


def _outcome(args: list[str], capsys: pytest.CaptureFixture[str],
             stopper: _StopAfterFirstStep, out: Path) -> bool:
    """Whether the CLI handled ``args`` cleanly: the input trained its first update and
    was stopped (exit 130) leaving a run folder a ``--resume`` can take up; or the run
    diverged at once (exit 3, one line, recorded); or it was refused (exit 2, one line)
    with nothing written."""
    before = stopper.fired
    code, _, err = in_process(args, capsys)
    if stopper.fired > before:
        return code == 130 and "Traceback" not in err and _run_state(out) == "interrupted"
    if clean_error(code, err, expect=3):
        return _run_state(out) == "diverged"
    return clean_error(code, err) and not out.exists()


def _run_state(run: Path) -> str | None:
    """The state of a run folder whose record reads back (else None)."""
    from qkgeom.runs import load_config, read_status

    if not run.is_dir():
        return None
    load_config(run)
    return (read_status(run) or {}).get("state")


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
    tally("data prepare", ok)
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
@example(pairs=[("steps", 6), ("probe_every", 1), ("model.dropout", 0.5)])  # accepted: runs
@example(pairs=[("key_control.mode", "hold"), ("key_control.scope", "head")])
def test_train_set_fuzz(pairs: list[tuple[str, object]], sample_data: Path,
                        tmp_path_factory: pytest.TempPathFactory,
                        capsys: pytest.CaptureFixture[str],
                        first_step: _StopAfterFirstStep) -> None:
    root = tmp_path_factory.mktemp("train")
    out = root / "run"
    args = ["train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
            "--quiet"]
    for key, value in pairs:
        args += ["--set", _set(key, value)]
    ran = first_step.fired
    ok = _outcome(args, capsys, first_step, out)
    tally("train --set", ok, first_step.fired > ran)
    shutil.rmtree(root)
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
                                capsys: pytest.CaptureFixture[str],
                                first_step: _StopAfterFirstStep) -> None:
    root = tmp_path_factory.mktemp("cfg")
    cfg = root / "cfg.yaml"
    cfg.write_text(text, encoding="latin-1", errors="replace")
    out = root / "run"
    ran = first_step.fired
    ok = _outcome(["train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
                   "--quiet", "--config", str(cfg)], capsys, first_step, out)
    tally("train --config", ok, first_step.fired > ran)
    shutil.rmtree(root)
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
@example(text="name: g\npreset: smoke\naxes: {seed: [0, 1], lr: [0.001]}\n")  # accepted: runs
def test_sweep_grid_fuzz(text: str, sample_data: Path, tmp_path_factory: pytest.TempPathFactory,
                         capsys: pytest.CaptureFixture[str],
                         first_step: _StopAfterFirstStep) -> None:
    root = tmp_path_factory.mktemp("grid")
    grid = root / "grid.yaml"
    grid.write_text(text)
    out = root / "sweep"
    before = first_step.fired
    code, _, err = in_process(["sweep", "run", str(grid), "--out", str(out), "--quiet"], capsys)
    if first_step.fired > before:  # sweep.json records the grid; its first run really ran
        started = [p for p in (out / "runs").iterdir() if (p / "status.json").exists()]
        ok = (code == 130 and "Traceback" not in err and bool(read_json(out / "sweep.json")
              ["runs"]) and len(started) == 1 and _run_state(started[0]) == "interrupted")
    else:
        ok = clean_error(code, err) and not out.exists()
    tally("sweep run grid", ok, first_step.fired > before)
    shutil.rmtree(root)
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
                         first_step: _StopAfterFirstStep) -> None:
    import qkgeom
    from qkgeom.errors import DivergedError, QKGeomError

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
    tally("make_config", ok)
    assert ok, nested
    # A config built in Python with one ill-typed or impossible field: building it (it is
    # validated then) or train() must refuse it before writing anything, or train it
    # (stopped after its first update).
    (prefix, name), value = change
    cfg = qkgeom.make_config("smoke", {"data": str(sample_data)})
    root = tmp_path_factory.mktemp("api")
    out = root / "run"
    before = first_step.fired
    try:
        if prefix:
            section = prefix.rstrip(".")
            inner = dataclasses.replace(getattr(cfg, section), **{name: value})
            cfg = dataclasses.replace(cfg, **{section: inner})
        else:
            cfg = dataclasses.replace(cfg, **{name: value})
        qkgeom.train(cfg, out)
        ok = False  # steps >= 1 always: the stopper ends every run that starts
    except _FirstStepDone:
        ok = _run_state(out) == "interrupted"
    except DivergedError:
        ok = _run_state(out) == "diverged"
    except QKGeomError:
        ok = not out.exists()
    except Exception:
        ok = False
    tally("qkgeom.train(config)", ok, first_step.fired > before)
    shutil.rmtree(root)
    assert ok, (prefix + name, value)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["random bytes corpus", "grid not a mapping",
                                  "config n_embd % n_head", "unknown init", "dose 0",
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
                 "dose 0": ["--key-control", "shrink", "--dose", "0"],
                 "probe_every > steps": ["--steps", "5", "--probe-every", "10"]}[case]
        res = cli("train", "--preset", "smoke", "--data", str(sample_data), "--out", str(out),
                  "--quiet", *flags)
    ok = clean_error(res.returncode, res.stderr) and not out.exists()
    tally("real subprocesses", ok)
    assert ok, (case, res.returncode, res.stderr)
