"""E2's null a shared profile cannot pass (protocol 2, docs/protocols.md#e2): the within-run
ρ of the changes minus the mean cross-run ρ of the same depth and setting.

Taking changes removes a linear trend, not a shared non-linear one: runs that follow one
non-linear course with no link between PR_K, pr_qk and the entropy inside a run still give a
positive within-run ρ (protocol 1's primary row is *supported* on nearly every such sweep),
while the null-adjusted row must be *supported* in at most the nominal share; a link planted
inside each run must still be found.
"""

from __future__ import annotations

import numpy as np
import pytest

from qkgeom.analysis import stats
from qkgeom.analysis.e1.claims import NO_NULL, evaluate_claims
from qkgeom.analysis.e1.trajectories import cross_run_null, layer_statistics, run_stats

from .synthetic import Run, table_of

N_SETS = 200
BOUND = 0.05 + 3 * np.sqrt(0.05 * 0.95 / N_SETS)
STEPS = list(range(0, 401, 40))  # the demo's probes: 11, the reference at 120
REF = 100
N_RUNS, N_LAYERS = 10, 2


def test_spearman_cross_is_spearman_of_every_pair():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 3, 7)), rng.normal(size=(4, 3, 7))
    x[1, 2] = 5.0  # a constant series: no ρ
    y[2, :, :3] = y[2, :, 3:6]  # ties: average ranks
    cross = stats.spearman_cross(x, y)
    pairs = np.array([[stats.spearman(x[i], y[j])[0] for j in range(4)] for i in range(4)])
    assert cross.shape == (4, 4, 3)
    assert np.array_equal(np.isnan(cross), np.isnan(pairs))
    assert np.allclose(cross[np.isfinite(cross)], pairs[np.isfinite(pairs)], atol=1e-12)
    assert np.isnan(stats.spearman_cross(x[..., :1], y[..., :1])).all()  # one change: no ρ


def test_cross_run_null_by_hand():
    """Three runs, one layer, four changes: run i's null is the mean of ρ(x_i, y_j) over
    j ≠ i (never its own pair)."""
    x = np.array([[[1.0, 2.0, 3.0, 4.0]], [[4.0, 3.0, 2.0, 1.0]], [[1.0, 3.0, 2.0, 4.0]]])
    y = np.array([[[1.0, 2.0, 3.0, 4.0]], [[1.0, 2.0, 4.0, 3.0]], [[4.0, 3.0, 2.0, 1.0]]])
    # ranks of x0 = 1 2 3 4; y1 = 1 2 4 3 -> ρ = 1 − 6·2/(4·15) = 0.8; y2 reversed -> −1
    null = cross_run_null(x, y)
    assert null.shape == (3, 1)
    assert null[0, 0] == pytest.approx((0.8 - 1.0) / 2)
    # x1 reversed: with y0 −1, with y2 +1
    assert null[1, 0] == pytest.approx(0.0)
    # x2 = 1 3 2 4: with y0 ρ = 1 − 6·2/60 = 0.8; with y1 (1 2 4 3) ρ = 1 − 6·6/60 = 0.4
    assert null[2, 0] == pytest.approx(0.6)
    assert np.isnan(cross_run_null(x[:1], y[:1])).all()  # one run: nothing to pair with


def _series(rng: np.random.Generator, n_sets: int, link: float) -> dict[str, np.ndarray]:
    """PR_K, pr_qk and entropy of ``n_sets`` sweeps × runs × layers × probes: every run
    follows one shared non-linear profile (a rise and fall after the reference, on a
    falling curve) with its own amplitude, plus its own noise per quantity; ``link``
    carries the run's own PR_K fluctuation into pr_qk and pr_qk's into the entropy."""
    t = np.asarray(STEPS) / STEPS[-1]
    f = 3.0 * np.exp(-((t - 0.55) / 0.15) ** 2) - 2.0 * t**2
    shape = (n_sets, N_RUNS, N_LAYERS, len(t))
    amp = 1.0 + 0.3 * rng.normal(size=(*shape[:3], 1))
    own_k, own_qk, own_e = (0.4 * rng.normal(size=shape) for _ in range(3))
    k = 10.0 + amp * f + own_k
    qk = 5.0 + amp * f + link * own_k + own_qk
    ent = 2.0 + amp * f + link * (link * own_k + own_qk) + own_e
    return {"pr_k": k, "pr_qk": qk, "attn_entropy": ent}


def _run_values(series: dict[str, np.ndarray], a: str, b: str) -> tuple[np.ndarray, ...]:
    """Per sweep and run, from the reference probe (step 120): the within-run ρ of the
    changes and the null-adjusted value, each the mean over the run's layers, through the
    functions ``layer_statistics`` calls."""
    i0 = STEPS.index(120)
    x = np.diff(series[a][..., i0:], axis=-1)
    y = np.diff(series[b][..., i0:], axis=-1)
    within, _ = stats.spearman(x, y)  # (sets, runs, layers)
    null = np.stack([cross_run_null(xs, ys) for xs, ys in zip(x, y, strict=True)])
    return within.mean(-1), (within - null).mean(-1)


def _supported_share(values: np.ndarray) -> float:
    """Share of sweeps whose runs' values get *supported* from the verdict rule alone, at
    α unadjusted (stricter than the primary rows' Holm-adjusted family)."""
    calls = []
    for v in values:
        u = stats.unit_test(v, +1)
        calls.append(stats.verdict(u["k"], u["n"], u["p_value"],
                                   p_opposite=u["p_opposite"]) == stats.SUPPORTED)
    return float(np.mean(calls))


@pytest.mark.parametrize("pair", [("pr_k", "pr_qk"), ("pr_qk", "attn_entropy")],
                         ids=["E2.1", "E2.2"])
def test_a_shared_profile_alone_is_not_supported(pair):
    series = _series(np.random.default_rng(36), N_SETS, link=0.0)
    within, adjusted = _run_values(series, *pair)
    assert within.mean() > 0.3  # the shared profile makes the changes agree in a run...
    assert _supported_share(within) > 0.9  # ... so protocol 1's row passes it
    assert _supported_share(adjusted) <= BOUND
    assert abs(adjusted.mean()) < 0.02  # the null takes what the profile gives


@pytest.mark.parametrize("pair", [("pr_k", "pr_qk"), ("pr_qk", "attn_entropy")],
                         ids=["E2.1", "E2.2"])
def test_a_planted_within_run_link_is_found(pair):
    series = _series(np.random.default_rng(37), 40, link=1.0)
    _, adjusted = _run_values(series, *pair)
    assert adjusted.mean() > 0.1
    assert _supported_share(adjusted) >= 0.9


def _runs(series: dict[str, np.ndarray], sweeps: range) -> list[Run]:
    """Runs of ``series`` for ``table_of``: per sweep (a variant) two inits × 5 seeds."""
    out = []
    for s in sweeps:
        for r in range(N_RUNS):
            k, qk, ent = (series[m][s, r] for m in ("pr_k", "pr_qk", "attn_entropy"))
            q = np.full_like(k, 10.0)
            out.append(Run(f"s{s}/r{r}", r, depth=N_LAYERS, variant=f"sweep{s}",
                           qk_init="normal" if r < 5 else "tied",
                           layers={"pr_k_token": k, "pr_qk_token": qk, "attn_entropy": ent,
                                   "pr_q_token": q, "contrast_token": q - k}))
    return out


def test_the_pipeline_pools_the_inits_of_one_depth_and_setting():
    """``layer_statistics`` gives each run the null of the other runs of its sweep (both
    inits, one variant, one depth), as computed directly; a run alone at its depth has
    none, and the claims row says why when no run has one."""
    series = _series(np.random.default_rng(5), 3, link=0.5)
    runs = _runs(series, range(3))
    lone = Run("lone", 99, depth=3, variant="sweep0",
               layers={"pr_k_token": np.ones((3, len(STEPS))) + np.arange(len(STEPS)) ** 1.5,
                       "pr_qk_token": np.ones((3, len(STEPS))) + np.arange(len(STEPS)) ** 0.5,
                       "pr_q_token": np.full((3, len(STEPS)), 9.0),
                       "contrast_token": np.zeros((3, len(STEPS))),
                       "attn_entropy": np.ones((3, len(STEPS))) + np.sin(np.arange(len(STEPS)))})
    per_layer, traj = layer_statistics(table_of([*runs, lone], STEPS, REF), levels=("token",))
    ref = run_stats(per_layer)
    ref = ref[ref["origin"] == "reference"].set_index("run_id")
    _, adjusted = _run_values(series, "pr_k", "pr_qk")
    for s in range(3):
        got = ref.loc[[f"s{s}/r{r}" for r in range(N_RUNS)], "rho_k_qk_vs_null"]
        assert np.allclose(got.to_numpy(), adjusted[s], atol=1e-12)
    assert np.isnan(ref.loc["lone", "rho_k_qk_vs_null"])
    assert np.isfinite(ref.loc["lone", "rho_k_qk"])
    alone = evaluate_claims(per_layer[per_layer["run_id"] == "lone"], traj.iloc[0:0])
    row = alone[(alone["claim_id"] == "E2.1") & (alone["statistic"] == "rho_k_qk_vs_null")
                & alone["layer"].isna() & (alone["origin"] == "reference")].iloc[0]
    assert row["n"] == 0 and row["reason"] == NO_NULL and row["verdict"] == "not evaluated"
