"""Planted effects are found and null sweeps are not: simulated sweeps through the real E1
and E3 statistics (in memory, no files).

Each null sweep has no effect at the unit level but a **shared random effect within each
run** (every layer of a run drifts with the run), the structure that made layers look like
54 independent units: the tests over independent units must call a null sweep "supported"
in at most the nominal share (≤ 0.05 + 3 standard errors), and the old layer count must
fail that bound on the same sweeps, so the check can fail. E3's nulls are also tested as
nulls: "equivalent to no effect" comes out at about the power the design states.

Many sweeps are collated into one table (each its own variant, or its own pair groups) so
the per-row work is done once; each sweep's claims are then decided on its own rows by
the same functions a report calls.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import stats
from qkgeom.analysis.e1.claims import CLAIMS, evaluate_claims
from qkgeom.analysis.e1.trajectories import layer_statistics
from qkgeom.analysis.e3 import manipulation_summary
from qkgeom.analysis.e3.evaluate import e3_tables, e3_verdicts
from qkgeom.analysis.e3.paired import PREDICTED, in_windows

from .synthetic import Run, table_of

N_SWEEPS = 200
BOUND = 0.05 + 3 * np.sqrt(0.05 * 0.95 / N_SWEEPS)

E1_STEPS = [0, 10, 20, 30, 40, 50]
E1_REF = 13  # -> the reference probe is step 20
E1_CLAIMS = ("E1.1", "E1.2", "E1.3", "E2.1", "E2.2", "E2.3")


def e1_runs(rng: np.random.Generator, effect: float, sweep: int = 0) -> list[Run]:
    """One sweep: 2 inits × 5 seeds (10 runs: the six primary rows are Holm-adjusted
    together, and 1/2^10 × 6 < 0.05), 3 layers, 3 heads, token level (the primary level). ``effect`` = 0: every
    run drifts by its own random amount, shared by its layers, in each quantity
    independently; 1: PR_Q expands, PR_K shrinks, pr_qk follows PR_K, entropy follows
    pr_qk (over steps and across heads)."""
    t = np.asarray(E1_STEPS, dtype=float) / E1_STEPS[-1]
    n_layers, n_heads = 3, 3

    def drift(center: float) -> np.ndarray:  # (L, T): run effect + layer effect + noise
        run = rng.normal(center, 1.0)
        layer = rng.normal(0.0, 0.3, size=(n_layers, 1))
        return (run + layer) * t + 0.3 * rng.normal(size=(n_layers, len(t)))

    runs = []
    for i, (init, seed) in enumerate((i, s) for i in ("normal", "tied") for s in range(5)):
        free = 1.0 - 0.9 * effect  # how much of pr_qk and entropy moves on its own
        q = 10.0 + drift(3.0 * effect)
        k = 10.0 + drift(-3.0 * effect)
        qk = 5.0 + effect * 0.5 * (k - 10.0) + free * drift(0.0)
        ent = 2.0 + effect * 0.5 * (qk - 5.0) + free * drift(0.0)
        # heads: per-run offsets shared by the run's layers (null), or entropy following pr_qk
        qk_h = 5.0 + rng.normal(size=(1, n_heads, 1)) \
            + 0.3 * rng.normal(size=(n_layers, n_heads, len(t)))
        ent_h = (2.0 + effect * (qk_h - 5.0) + free * rng.normal(size=(1, n_heads, 1))
                 + 0.3 * free * rng.normal(size=(n_layers, n_heads, len(t))))
        runs.append(Run(f"s{sweep}/r{i}", seed, qk_init=init, depth=n_layers,
                        variant=f"sweep{sweep}",
                        layers={"pr_q_token": q, "pr_k_token": k, "contrast_token": q - k,
                                "pr_qk_token": qk, "attn_entropy": ent},
                        heads={"pr_qk_token": qk_h, "attn_entropy": ent_h}))
    return runs


def e1_verdicts(runs: list[Run]) -> pd.DataFrame:
    """The token-level claims of every sweep in ``runs`` (one per variant), with the
    verdict the old unit would give: seed-averaged layer trajectories, exact sign test."""
    per_layer, traj = layer_statistics(table_of(runs, E1_STEPS, E1_REF), levels=("token",))
    by_id = {c.id: c for c in CLAIMS}
    frames = []
    layers_of = dict(tuple(per_layer.groupby("variant")))
    for variant, tr in traj.groupby("variant"):
        claims = evaluate_claims(layers_of[variant], tr)
        claims = claims[claims["level"] == "token"].copy()
        old = tr.set_index("origin")
        claims["old_verdict"] = [
            stats.verdict(ct["k"], ct["n"], ct["p_value"]) for ct in (
                stats.count_test(old.loc["step0" if o == "last" else o,
                                         by_id[c].statistic], by_id[c].sign)
                for c, o in zip(claims["claim_id"], claims["origin"], strict=True))]
        frames.append(claims.assign(sweep=variant))
    return pd.concat(frames, ignore_index=True)


def test_e1_planted_effect_is_supported():
    claims = e1_verdicts(e1_runs(np.random.default_rng(11), effect=1.0))
    assert set(claims["claim_id"]) == set(E1_CLAIMS)
    primary = claims[claims["role"] == "primary"]
    assert len(primary) == 6 and (primary["family"] == 6).all()
    assert (primary["verdict"] == "supported").all(), primary[
        ["claim_id", "origin", "measured", "p_value", "p_adj", "verdict"]]


@pytest.mark.slow
def test_e1_null_sweeps_are_rarely_supported_and_layer_counts_would_be():
    rng = np.random.default_rng(12)
    sims = e1_verdicts([r for i in range(N_SWEEPS) for r in e1_runs(rng, 0.0, sweep=i)])
    assert sims["sweep"].nunique() == N_SWEEPS
    share = sims.groupby(["claim_id", "origin"])["verdict"].agg(
        lambda v: float((v == "supported").mean()))
    assert (share <= BOUND).all(), share
    old = sims.groupby(["claim_id", "origin"])["old_verdict"].agg(
        lambda v: float((v == "supported").mean()))
    assert old.loc[("E1.1", "step0")] > BOUND and old.loc[("E1.2", "step0")] > BOUND, old


E3_STEPS = list(range(0, 101, 10))
E3_ARMS = {"none": {"mode": "none"}, "sham-token-data": {"mode": "sham"},
           "hold-token-data": {"mode": "hold"},
           "shrink-0.5-token-data": {"mode": "shrink", "dose": 0.5}}
E3_ROWS = ("E3.1", "E3.2", "E3.3", "E3.4")
E3_SEEDS = 10
E3_DRIFT = 0.2  # sd of a seed's drift per unit of time: its whole-run mean has sd 0.11


def e3_runs(rng: np.random.Generator, n_seeds: int, entropy_effect: float,
            sweep: int = 0) -> list[Run]:
    """Seeds × (none, sham, hold, shrink); the control acts on the token-level PR_K as
    intended in every seed and layer. The arms' entropies and pr_qk differ from none by a
    random seed × arm drift (null: the unit values are N(0, (E3_DRIFT · 0.55)²) over the
    whole run), plus ``entropy_effect`` × step/steps in the predicted direction (shrink −,
    hold +)."""
    t = np.asarray(E3_STEPS, dtype=float) / E3_STEPS[-1]
    n_layers = 2
    runs = []
    for seed in range(n_seeds):
        k_none = 20.0 - 10.0 * t + 0.2 * rng.normal(size=(n_layers, len(t)))
        base = {m: 3.0 + rng.normal(size=(n_layers, 1)) * t
                for m in ("attn_entropy", "attn_entropy_scalefree", "pr_qk_weight",
                          "pr_qk_token", "logit_std_row")}
        for arm, control in E3_ARMS.items():
            mode = control["mode"]
            k = {"shrink": 0.5 * k_none, "hold": np.repeat(k_none[:, :1], len(t), axis=1)}.get(
                mode, k_none).copy()
            k[:, 0] = k_none[:, 0]  # identical at step 0
            sign = {"shrink": -1.0, "hold": 1.0}.get(mode, 0.0)
            layers = {"pr_k_token": k, "pr_k_weight": k}
            for m, v in base.items():
                drift = rng.normal(0.0, E3_DRIFT) * t if mode != "none" else 0.0
                planted = sign * entropy_effect * t if m != "logit_std_row" else 0.0
                layers[m] = v + drift + planted + 0.001 * rng.normal(size=v.shape) * (t > 0)
            extra = {f"ctl_dose_l{i}": 1.0 - 0.5 * np.minimum(t / 0.2, 1.0)
                     for i in range(n_layers)} if mode == "shrink" else {}
            runs.append(Run(f"{sweep}:seed={seed},arm={arm}", seed, layers=layers,
                            control=control, pair_key=f"{sweep}:{seed}", extra=extra))
    return runs


def e3_claims(runs: list[Run]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(claims of every sweep, the per-unit manipulation table, the paired
    differences)`` for the sweeps in ``runs`` (run ids ``<sweep>:seed=…``, pair keys
    ``<sweep>:<seed>``); ``sweep`` columns say whose."""
    tables = e3_tables(table_of(runs, E3_STEPS, ref_step=25))
    sweep_of = tables["members"].drop_duplicates("group").set_index("group")["run_id"] \
        .str.split(":").str[0]
    windows, units, paired = (tables[k].assign(sweep=lambda f: f["group"].map(sweep_of))
                              for k in ("windows", "manipulation_units", "paired"))
    units_of = dict(tuple(units.groupby("sweep")))
    frames = [e3_verdicts(w, units_of[sweep])["claims"].assign(sweep=sweep)
              for sweep, w in windows.groupby("sweep")]
    return pd.concat(frames, ignore_index=True), units, paired


def probes_as_units(paired: pd.DataFrame) -> pd.Series:
    """The share of sweeps in which a pseudo-replicating analysis finds a significant
    effect (p < 0.05), per arm, quantity and window: every (seed, probe) difference as a
    unit, exact sign test."""
    sel = paired[(paired["baseline"] == "none") & paired["mode"].isin(["shrink", "hold"])
                 & paired["quantity"].isin(["attn_entropy_scalefree", "pr_qk_token"])]
    sel = in_windows(sel, dict.fromkeys(sel["group"].unique(), E3_STEPS[-1]))
    p = sel.groupby(["sweep", "arm", "quantity", "window"]).apply(
        lambda g: stats.count_test(g["diff"], PREDICTED[(g["mode"].iloc[0], g.name[2])])[
            "p_value"], include_groups=False)
    return (p < stats.ALPHA).groupby(level=[1, 2, 3]).mean()


def test_e3_planted_effect_is_supported_and_its_manipulation_passes():
    claims, units, _ = e3_claims(e3_runs(np.random.default_rng(21), 5, entropy_effect=2.0))
    gated = units[units["mode"].isin(["shrink", "hold"])]
    assert gated["passed"].all() and set(gated["unit"]) == {"l0", "l1"}
    primary = claims[claims["claim_id"].isin(E3_ROWS) & (claims["role"] == "primary")]
    assert len(primary) == 4 and (primary["verdict"] == "supported").all(), primary[
        ["claim_id", "claim", "origin", "measured", "p_value", "verdict"]]


def test_e3_manipulation_summary_lists_each_arm_in_seed_order():
    """The report's per-seed lists read seed 0, 1, 2, … (pair groups are numbered by
    their config hash, which is no order a reader can follow)."""
    _, units, _ = e3_claims(e3_runs(np.random.default_rng(23), 12, entropy_effect=0.0))
    summary = manipulation_summary(units)
    for _, g in summary.groupby(["arm", "window"]):
        assert list(g["seed"]) == list(range(12))


def test_e3_manipulation_markdown_lists_few_seeds_and_summarises_many():
    """Up to 8 seeds each seed's ratio is listed; 12 give the median and the range, which
    are those of the per-seed table."""
    from qkgeom.analysis.e3.report import manipulation_markdown

    for n in (4, 12):
        _, units, _ = e3_claims(e3_runs(np.random.default_rng(24), n, entropy_effect=0.0))
        summary = manipulation_summary(units)
        text = manipulation_markdown(summary, {})
        row = summary[(summary["mode"] == "shrink") & (summary["window"] == "whole")]
        achieved = row["achieved"].to_numpy()
        if n == 4:
            assert ", ".join(f"{a:.3f}" for a in achieved) in text
        else:
            assert (f"median {np.median(achieved):.3f} [{achieved.min():.3f}, "
                    f"{achieved.max():.3f}] over 12 seeds") in text


@pytest.mark.slow
def test_e3_null_sweeps_are_rarely_supported_and_equivalent_at_the_stated_power():
    """(c) 200 null sweeps of 10 seeds: every row is called supported in at most the
    nominal share; the primary entropy rows are called equivalent to no effect (±0.1 nats)
    in about the share the power calculation gives for their unit spread (within 3
    standard errors); a pseudo-replicating count of probes would call them supported."""
    rng = np.random.default_rng(22)
    claims, _, paired = e3_claims(
        [r for i in range(N_SWEEPS) for r in e3_runs(rng, E3_SEEDS, 0.0, sweep=i)])
    sims = claims[claims["claim_id"].isin(E3_ROWS)]
    assert sims["sweep"].nunique() == N_SWEEPS
    assert (sims["verdict"] != "not evaluated").all()  # the manipulation happened
    share = sims.groupby(["claim", "level", "criterion", "origin"])["verdict"].agg(
        lambda v: float((v == "supported").mean()))
    assert len(share) == 16 and (share <= BOUND).all(), share
    power = stats.equivalence_power(E3_DRIFT * np.mean(E3_STEPS[1:]) / E3_STEPS[-1], E3_SEEDS,
                                    0.1)
    assert 0.3 < power < 0.95  # a design whose equivalence rate the check can see
    se = np.sqrt(power * (1 - power) / N_SWEEPS)
    for cid in ("E3.1", "E3.2"):
        rows = sims[(sims["claim_id"] == cid) & (sims["role"] == "primary")]
        rate = float((rows["verdict"] == "equivalent to no effect").mean())
        assert abs(rate - power) <= 3 * se, (cid, rate, power)
    old = probes_as_units(paired)  # over the whole run, each seed's probes share its drift
    assert old.xs("whole", level="window").mean() > 3 * BOUND, old
