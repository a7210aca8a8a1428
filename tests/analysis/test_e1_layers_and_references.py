"""Protocol 2's secondary E1 views: per-layer rows show a layer that goes against the rest,
and the reference-sensitivity table is the E1 statistics recomputed with the reference at
each probe from 5 % to 75 % of the run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qkgeom.analysis import stats
from qkgeom.analysis.e1.claims import evaluate_claims, sensitivity_summary
from qkgeom.analysis.e1.trajectories import layer_statistics, reference_sensitivity, run_stats

from .synthetic import Run, table_of

STEPS = list(range(0, 401, 40))
REF = 100  # -> the protocol's reference probe is step 120


def _runs(rng: np.random.Generator, layer_moves: list[float], n_runs: int = 12,
          depth_of=lambda r: 4, levels=("token",)) -> list[Run]:
    """Runs whose PR_K moves by ``layer_moves[layer]`` from the reference (step 120) to
    the end, linearly, plus noise; PR_Q rises everywhere; pr_qk and entropy random."""
    t = np.asarray(STEPS, dtype=float)
    ramp = np.clip((t - 120) / (400 - 120), 0.0, None)
    runs = []
    for r in range(n_runs):
        depth = depth_of(r)
        moves = np.asarray(layer_moves[:depth])[:, None]
        noise = 0.05 * rng.normal(size=(depth, len(t)))
        layers = {}
        for level in levels:
            k = 10.0 + 5.0 * np.exp(-t / 40) + moves * ramp + noise
            q = 12.0 + 0.01 * t + 0.05 * rng.normal(size=(depth, len(t)))
            layers.update({f"pr_k_{level}": k, f"pr_q_{level}": q, f"contrast_{level}": q - k,
                           f"pr_qk_{level}": 5.0 + rng.normal(size=(depth, len(t)))})
        layers["attn_entropy"] = 2.0 + rng.normal(size=(depth, len(t)))
        runs.append(Run(f"r{r}", r, layers=layers, depth=depth,
                        qk_init="normal" if r % 2 else "tied"))
    return runs


def test_per_layer_rows_show_one_layer_against_the_rest():
    """Layer 0's keys shrink by 4 while layers 1–3 expand by 1 (on a common decay of 0.25
    after the reference): every run's layer mean shrinks (−0.5), so the primary E1.2 row is
    supported; the per-layer rows say that it is layer 0 against the rest."""
    runs = _runs(np.random.default_rng(0), [-4.0, 1.0, 1.0, 1.0])
    per_layer, traj = layer_statistics(table_of(runs, STEPS, REF), levels=("token",))
    claims = evaluate_claims(per_layer, traj)
    e12 = claims[claims["claim_id"] == "E1.2"]
    primary = e12[e12["role"] == "primary"].iloc[0]
    assert primary["verdict"] == "supported"
    assert primary["mean"] == pytest.approx(-0.5, abs=0.05)
    rows = e12[e12["layer"].notna()].set_index("layer")
    assert list(rows.index) == [0, 1, 2, 3] and (rows["role"] == "secondary").all()
    assert (rows["n"] == 12).all()
    assert rows.loc[0, "verdict"] == "supported" and rows.loc[0, "k"] == 12
    assert rows.loc[0, "mean"] == pytest.approx(-4.25, abs=0.1)
    assert (rows.loc[[1, 2, 3], "verdict"] == "not supported").all()
    assert (rows.loc[[1, 2, 3], "k"] == 0).all()
    assert rows.loc[2, "from"] == "reference, step 120 · layer 2"
    assert rows["family"].eq(primary["family"]).sum() == 0  # Holm with the secondary rows


def test_per_layer_rows_count_the_runs_that_have_the_layer():
    runs = _runs(np.random.default_rng(1), [-1.0] * 6, depth_of=lambda r: 6 if r < 4 else 4)
    per_layer, traj = layer_statistics(table_of(runs, STEPS, REF), levels=("token",))
    claims = evaluate_claims(per_layer, traj)
    rows = claims[(claims["claim_id"] == "E1.1") & claims["layer"].notna()]
    assert rows.set_index("layer")["n"].to_dict() == {0: 12, 1: 12, 2: 12, 3: 12, 4: 4, 5: 4}


def test_the_sensitivity_table_is_the_e1_statistics_at_each_reference():
    """Each row equals ``layer_statistics`` → ``run_stats`` run again with the run's
    reference step set to that probe (the existing E1 functions), per run and summarised."""
    runs = _runs(np.random.default_rng(2), [-2.0, 0.5, 1.0, 3.0, 0.0, 0.0], n_runs=8,
                 depth_of=lambda r: 6 if r < 4 else 4, levels=("token", "weight"))
    data = table_of(runs, STEPS, REF)
    per_run = reference_sensitivity(data)
    # every probe from 5 % (20) to 75 % (300) of the 400 steps: 40, 80, ..., 280
    assert sorted(per_run["reference_step"].unique()) == [40, 80, 120, 160, 200, 240, 280]
    assert set(per_run.loc[per_run["primary"], "reference_step"]) == {120}
    assert set(per_run["level"]) == {"token", "weight"}
    summary = sensitivity_summary(per_run)
    assert len(summary) == 7 * 2 * 2  # references × levels × (E1.1, E1.2)
    for step in sorted(per_run["reference_step"].unique()):
        moved = dataclasses.replace(data, runs=data.runs.assign(ref_step=int(step)))
        again = run_stats(layer_statistics(moved)[0])
        again = again[again["origin"] == "reference"].set_index(["level", "run_id"])
        mine = per_run[per_run["reference_step"] == step].set_index(["level", "run_id"])
        assert (again.loc[mine.index, "start_step"] == step).all()
        for stat in ("delta_pr_q", "delta_pr_k"):
            assert np.allclose(mine[stat], again.loc[mine.index, stat], atol=1e-12), stat
        for (level, cid, stat, sign) in (("token", "E1.1", "delta_pr_q", 1),
                                         ("weight", "E1.2", "delta_pr_k", -1)):
            row = summary[(summary["reference_step"] == step) & (summary["level"] == level)
                          & (summary["claim_id"] == cid)].iloc[0]
            u = stats.unit_test(again.loc[level, stat], sign)
            assert (row["k"], row["n"]) == (u["k"], u["n"]) == (u["k"], 8)
            assert row["mean"] == pytest.approx(u["mean"])
            assert row["p_value"] == pytest.approx(u["p_value"])
            assert row["ci_low"] == pytest.approx(u["ci_low"])
