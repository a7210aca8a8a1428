"""Would the tests catch a wrong implementation? Plant small bugs, one at a time, and see.

Each mutation is a (file, old text, new text) replacement in a temporary copy of the
working tree (``src``, ``tests``, ``pyproject.toml``), a plausible slip such as ``≥``
written ``>``, a dropped factor 2 or a missing restore. For each, the test files that
should notice it run in that copy (not the whole suite: a targeted list per mutation, so
the whole check takes minutes); the table says whether they failed, and which test
failed first. Before any mutation the same test files run unmutated: a mutation only
counts as caught if its tests passed without it.

    python benchmarks/mutation_check.py              # every mutation
    python benchmarks/mutation_check.py --only verdict-share --only ci-level
    python benchmarks/mutation_check.py --list

Not collected by pytest (it lives in benchmarks/). The run is CPU-bound; on a shared
machine prefix it with ``nice``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``old`` (which must occur exactly once in ``file``) becomes
    ``new``; ``tests`` are the pytest targets expected to fail because of it."""

    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


STATS = "src/qkgeom/analysis/stats.py"
BOUNDARIES = "tests/analysis/test_boundaries.py"
RESUME = "tests/training/test_resume_state.py"
ENTROPY = "tests/geometry/test_geometry_entropy.py::test_low_precision_inputs_against_float64"
VERDICT = "tests/analysis/test_stats.py::test_verdict_rule"
UNIT = "tests/analysis/test_stats.py::test_unit_test_one_and_two_sided"
DATASETS = ("tests/data/test_data_prepare.py::test_datasets_route_matches_raw_files",
            "tests/data/test_data_prepare.py::test_analysis_text_through_datasets_is_the_raw_split")

MUTATIONS = (
    # --- the planted bugs ---------------------------------------------------------
    Mutation("verdict-share", "verdict: share >= 80 % written > 80 %", STATS,
             "ok = k / n >= SUPPORT_SHARE and", "ok = k / n > SUPPORT_SHARE and",
             (BOUNDARIES, VERDICT)),
    Mutation("ci-level", "t-interval at 90 % instead of 95 %", STATS,
             "CI_LEVEL = 0.95", "CI_LEVEL = 0.90",
             (BOUNDARIES, "tests/analysis/test_stats.py::test_t_interval_by_hand")),
    Mutation("mk-two-sided", "Mann-Kendall two-sided p without the factor 2",
             "src/qkgeom/analysis/e4/trends.py",
             "min(1.0, 2 * sst.norm.sf(abs(mk[\"z\"])))", "min(1.0, sst.norm.sf(abs(mk[\"z\"])))",
             (BOUNDARIES, "tests/analysis/test_trends.py::test_mann_kendall_by_hand")),
    Mutation("softmax-bf16", "attention softmax computed in bf16 (whole rows)",
             "src/qkgeom/geometry/entropy.py",
             "torch.log_softmax(s, dim=-1, out=logp)",
             "logp.copy_(torch.log_softmax(s.bfloat16(), dim=-1))",
             (ENTROPY,)),
    Mutation("resume-rng", "resume does not restore torch's RNG (dropout)",
             "src/qkgeom/training/trainer.py",
             '        torch.set_rng_state(state["torch_rng"])\n', "", (RESUME,)),
    Mutation("resume-oldest", "resume from the oldest checkpoint instead of the newest",
             "src/qkgeom/training/checkpoint.py",
             "for step, path in reversed(found):", "for step, path in found:", (RESUME,)),
    # --- more -----------------------------------------------------------------------------
    Mutation("softmax-bf16-online", "the online softmax's exponentials in bf16",
             "src/qkgeom/geometry/entropy.py",
             "e = d.exp()  # masked entries", "e = d.bfloat16().exp().to(d.dtype)  # masked entries",
             (ENTROPY,)),
    Mutation("verdict-opposite", "not supported at p' <= 0.05 instead of p' < 0.05", STATS,
             "if p_opposite < ALPHA:", "if p_opposite <= ALPHA:", (BOUNDARIES,)),
    Mutation("verdict-level", "the verdict's level p <= 0.05 instead of p < 0.05", STATS,
             "if p_value < ALPHA:", "if p_value <= ALPHA:", (BOUNDARIES,)),
    Mutation("verdict-equivalence", "equivalent at p_eq <= 0.05 instead of p_eq < 0.05", STATS,
             "if p_equiv < ALPHA and", "if p_equiv <= ALPHA and", (BOUNDARIES,)),
    Mutation("equivalence-units", "equivalence from more than 5 units instead of at least 5",
             STATS, "and n >= MIN_UNITS:", "and n > MIN_UNITS:", (BOUNDARIES,)),
    Mutation("holm", "Holm without the running maximum", STATS,
             "np.maximum.accumulate(p[order] * (m - np.arange(m)))",
             "p[order] * (m - np.arange(m))", ("tests/analysis/test_stats.py::test_holm_by_hand",)),
    Mutation("tost-bound", "TOST tests one side only", STATS,
             "return float(max(lower, upper))", "return float(upper)",
             ("tests/analysis/test_stats.py::test_tost_by_hand_and_its_edges",)),
    Mutation("gate-direction", "manipulation check: the direction hard-coded (>=)",
             "src/qkgeom/analysis/e3/manipulation.py",
             "np.where(i < 1, a <= threshold", "np.where(False, a <= threshold",
             ("tests/analysis/test_e3.py::test_the_hold_gate_points_the_way_the_uncontrolled_pr_k_moved",)),
    Mutation("gate-log", "manipulation check: halfway on the plain ratio decides (protocol 1)",
             "src/qkgeom/analysis/e3/manipulation.py",
             "threshold = np.sqrt(i) if protocol == 2", "threshold = (1.0 + i) / 2.0 if True",
             (BOUNDARIES,)),
    Mutation("flip-two-sided", "two-sided sign-flip p without the factor 2", STATS,
             "p_flip = min(1.0, 2 * min(", "p_flip = min(1.0, 1 * min(", (BOUNDARIES, UNIT)),
    Mutation("gate-shrink", "manipulation check: shrink must be strictly below halfway",
             "src/qkgeom/analysis/e3/manipulation.py",
             "a <= threshold, a >= threshold)", "a < threshold, a >= threshold)",
             (BOUNDARIES,)),
    Mutation("gate-hold", "manipulation check: hold must be strictly above halfway",
             "src/qkgeom/analysis/e3/manipulation.py",
             "a <= threshold, a >= threshold)", "a <= threshold, a > threshold)",
             (BOUNDARIES,)),
    Mutation("early-window", "E3 early window leaves out the probe at exactly 25 %",
             "src/qkgeom/analysis/e3/paired.py",
             '(frame["step"] <= share * run_len)', '(frame["step"] < share * run_len)',
             (BOUNDARIES,)),
    Mutation("regime-points", "regime call made on 3 checkpoints",
             "src/qkgeom/analysis/e4/regime.py", "MIN_POINTS = 4", "MIN_POINTS = 3",
             (BOUNDARIES,)),
    Mutation("regime-level", "regime call: p <= alpha counts as a rise",
             "src/qkgeom/analysis/e4/regime.py", "rise, fall = p_rise < alpha,",
             "rise, fall = p_rise <= alpha,", (BOUNDARIES,)),
    Mutation("surrogate-p", "surrogate p without the data's own count",
             "src/qkgeom/analysis/e4/regime.py", "return (1 + ge) / (1 + s),",
             "return ge / s,", (BOUNDARIES,)),
    Mutation("warmup-window", "the checkpoint where the warm-up ends left out of the rule",
             "src/qkgeom/analysis/e4/trends.py", "else steps >= warmup", "else steps > warmup",
             (BOUNDARIES,)),
    Mutation("e4-sidak", "E4.1/E4.2: the smallest layer p not adjusted for the layers",
             "src/qkgeom/analysis/e4/claims.py",
             "return float(-np.expm1(len(p) * np.log1p(-p.min())))",
             "return float(-np.expm1(np.log1p(-p.min())))",
             ("tests/analysis/test_regime.py::test_one_model_is_decided_by_its_own_sidak_adjusted_p",)),
    Mutation("e4-noise-flat", "E4: surrogates without the jitter term",
             "src/qkgeom/analysis/e4/regime.py",
             "eps = jitter[idx, None, None] * normals[None]", "eps = 0.0 * normals[None]",
             ("tests/analysis/test_regime.py",)),
    Mutation("e4-walk", "E4 over seeds: surrogates without the random walk",
             "src/qkgeom/analysis/e4/regime.py",
             "eps = eps + walk_sd[idx, None, None] * walk[None]",
             "eps = eps + 0.0 * walk[None]",
             ("tests/analysis/test_regime.py::"
              "test_over_seeds_a_slow_walk_within_each_run_is_not_a_regime",)),
    Mutation("e4-opposite", "E4.2/E4.3: the biased opposite direction read as not supported",
             "src/qkgeom/analysis/e4/claims.py", 'ONE_SIDED_ONLY = ("E4.2", "E4.3")',
             "ONE_SIDED_ONLY = ()",
             ("tests/analysis/test_regime.py::"
              "test_flat_data_never_read_not_supported_for_e4_2_and_e4_3",)),
    Mutation("reference-quarter", "the reference at 25 % rounded down",
             "src/qkgeom/config.py", "return math.ceil(self.steps / 4) if",
             "return self.steps // 4 if", (BOUNDARIES,)),
    Mutation("datasets-blank-lines", "WikiText through datasets: blank lines not restored",
             "src/qkgeom/data/sources.py",
             'out[split] = "".join(line if line else " \\n" for line in lines)',
             'out[split] = "".join(lines)', DATASETS),
    Mutation("wandb-histograms", "the W&B sink drops the histograms",
             "src/qkgeom/monitor/sinks.py",
             "        if self.histogram is not None:\n            data.update(",
             "        if False:\n            data.update(",
             ("tests/monitor/test_monitor_plain.py::"
              "test_wandb_gets_scalars_and_histograms_on_its_own_step_axis",)),
    Mutation("sweep-threads", "default threads per run rounded up",
             "src/qkgeom/experiments/runner.py",
             "threads_per_run or max(1, available_cpus() // workers)",
             "threads_per_run or max(1, -(-available_cpus() // workers))",
             ("tests/experiments/test_sweep.py::test_default_threads_split_the_cpus",)),
    Mutation("int-betas", "AdamW given the config's betas as they are (an int breaks it)",
             "src/qkgeom/training/trainer.py",
             "betas=(float(cfg.beta1), float(cfg.beta2))", "betas=(cfg.beta1, cfg.beta2)",
             ("tests/training/test_train.py::test_a_config_built_in_python_with_int_betas_trains",)),
)


def _copy_tree(dest: Path) -> None:
    """src, tests and pyproject.toml of the working tree (uncommitted edits included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _pytest(copy: Path, targets: tuple[str, ...], timeout: float) -> tuple[bool, str, float]:
    """(passed, first failing test or a note, seconds) of ``pytest targets`` in ``copy``."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CI", None)
    t0 = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rf",
                              "-p", "no:cacheprovider", *targets], cwd=copy, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if res.returncode == 0:
        return True, "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", res.stdout, flags=re.M)
    return False, failed[0] if failed else f"pytest exit {res.returncode}", seconds


def _apply(copy: Path, m: Mutation) -> str:
    """Plant ``m`` in ``copy``; returns the file's original text (to restore)."""
    path = copy / m.file
    text = path.read_text(encoding="utf-8")
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"{m.name}: the text to replace occurs {count} times in {m.file}; "
                         "the mutation no longer fits the code")
    path.write_text(text.replace(m.old, m.new), encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="a mutation's name")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:22s} {m.what}  [{m.file}]")
        return 0
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="qkgeom-mutants-"))
    try:
        _copy_tree(work)
        for m in chosen:  # every mutation still fits the code before anything runs
            _apply(work, m)
            shutil.copy2(ROOT / m.file, work / m.file)
        targets = sorted({t for m in chosen for t in m.tests})
        ok, first, seconds = _pytest(work, tuple(targets), args.timeout)
        print(f"unmutated: {len(targets)} targets {'pass' if ok else 'FAIL: ' + first} "
              f"({seconds:.0f} s)", flush=True)
        if not ok:
            return 2
        rows = []
        for m in chosen:
            original = _apply(work, m)
            try:
                passed, first, seconds = _pytest(work, m.tests, args.timeout)
            finally:
                (work / m.file).write_text(original, encoding="utf-8")
            rows.append((m, not passed, first, seconds))
            print(f"  {m.name}: {'caught' if not passed else 'NOT caught'} ({seconds:.0f} s)",
                  flush=True)
    finally:
        if args.keep:
            print(f"copy kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("| mutation | planted bug | caught? | by (first failing test) | s |")
    print("|---|---|---|---|---|")
    for m, caught, first, seconds in rows:
        print(f"| {m.name} | {m.what} | {'yes' if caught else '**no**'} | {first or '-'} "
              f"| {seconds:.0f} |")
    missed = sum(not caught for _, caught, _, _ in rows)
    print(f"\n{len(rows) - missed}/{len(rows)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
