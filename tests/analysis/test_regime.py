"""E4's regime call tells saturation from decay, through the real analysis code.

Synthetic layers on the E4 demo's checkpoint steps (0, 1, 2, 4, …, 64, 128, …, 1 024; the
LR warm-up ends at step 100, so the rule reads the 15 checkpoints from 128 on), built as
a contrast curve plus token-block noise (each block: the curve, a persistent offset of its
tokens and noise at every checkpoint; the all-token value: the blocks' mean) plus, where
said, checkpoint jitter (training noise the blocks do not see).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import stats
from qkgeom.analysis.e4.bootstrap import block_bootstrap
from qkgeom.analysis.e4.claims import e4_claims, seed_claims, seed_scores
from qkgeom.analysis.e4.regime import (
    FALL,
    MONOTONE,
    RISE_FALL,
    drift_variance,
    regime_calls,
    roughness,
    token_deviations,
)
from qkgeom.analysis.e4.trends import drift_over_seeds, trend_table

STEPS = np.array([0, 1, 2, 4, 8, 16, 32, *range(64, 1025, 64)], dtype=float)
WARMUP = 100
T = STEPS[STEPS >= WARMUP]  # the rule's 15 checkpoints
K = 8


def saturating(tau: float, t: np.ndarray = T) -> np.ndarray:
    return 1.0 - np.exp(-t / tau)


def rise_then_fall(lost: float, t: np.ndarray = T, top: float = 400.0) -> np.ndarray:
    """Linear up to 1 at step ``top``, then down linearly, ``lost`` of the gain gone by
    the last checkpoint."""
    return np.where(t < top, t / top, 1.0 - lost * (t - top) / (t[-1] - top))


def layers(curve: np.ndarray, n: int, seed: int, block_sd: float = 0.05,
           offset_sd: float = 0.05, jitter_sd: float = 0.0
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(all-token series (n, m), blocks (n, K, m))`` of ``n`` layers of ``curve``."""
    rng = np.random.default_rng(seed)
    m = len(curve)
    blocks = (curve + rng.normal(scale=block_sd, size=(n, K, m))
              + rng.normal(scale=offset_sd, size=(n, K, 1)))
    return blocks.mean(axis=1) + rng.normal(scale=jitter_sd, size=(n, m)), blocks


def regime_share(calls: np.ndarray) -> float:
    return float((calls == RISE_FALL).mean())


# --- (d) saturation is never a regime; decay is -----------------------------------------------

SATURATING = [(tau, jitter) for tau in (30, 100, 300) for jitter in (0.0, 0.03, 0.1)]


@pytest.mark.parametrize(("tau", "jitter"), SATURATING)
def test_layers_that_rise_and_level_off_are_not_called_a_regime(tau: float, jitter: float
                                                                ) -> None:
    """At most 5 % of saturating layers rise then fall, whether the rise is inside the
    rule's window (τ 300), mostly before it (τ 100: the issue's curve) or over before it
    (τ 30: a flat top, the least favourable monotone curve); with or without training
    jitter."""
    x, blocks = layers(saturating(tau), 600, seed=int(tau) + int(1000 * jitter))
    r = regime_calls(x, blocks)
    assert regime_share(r.call) <= 0.05
    assert (r.call != FALL).mean() >= 0.9  # no systematic fall either


def test_the_issue_curve_on_all_23_checkpoints_is_not_a_regime() -> None:
    """The issue's finding, 1 − e^(−t/100) plus noise on the demo's 23 checkpoints: the old
    rule called it a regime (rise then flat or rise then fall) in about 90 % of layers. The
    rule on every checkpoint (a family whose warm-up is unknown) calls it a monotone rise."""
    x, blocks = layers(saturating(100, STEPS), 600, seed=7, jitter_sd=0.03)
    r = regime_calls(x, blocks)
    assert regime_share(r.call) <= 0.05
    assert (r.call == MONOTONE).mean() >= 0.9


@pytest.mark.parametrize(("lost", "jitter", "recall"), [(0.3, 0.0, 0.95), (0.3, 0.03, 0.9),
                                                         (0.5, 0.1, 0.6)])
def test_layers_that_rise_then_fall_are_called_so(lost: float, jitter: float, recall: float
                                                  ) -> None:
    """Stated recall: a rise to step 400 that then loses 30 % of its gain is called rise
    then fall in ≥ 95 % of layers without jitter and ≥ 90 % with jitter 0.03 (3 % of the
    gain); losing half of it under jitter 0.1, in ≥ 60 %."""
    curve = rise_then_fall(lost)
    x, blocks = layers(curve, 300, seed=11, jitter_sd=jitter)
    r = regime_calls(x, blocks)
    assert regime_share(r.call) >= recall
    got = r.share_lost[r.call == RISE_FALL]  # the share of the gain lost it reports: the
    planted = (curve.max() - curve[-1]) / (curve.max() - curve[0])  # curve's, from step 128
    assert abs(np.median(got) - planted) < 0.1


def test_the_planted_checkpoint_jitter_is_recovered() -> None:
    """The jitter the token blocks do not see (training noise between checkpoints) is
    estimated from the series' second differences, less the token noise's share."""
    x, blocks = layers(saturating(300), 600, seed=4, jitter_sd=0.05)
    r = regime_calls(x, blocks)
    assert np.median(r.jitter_sd) == pytest.approx(0.05, rel=0.25)
    # token noise: the blocks' noise and their persistent offsets, as a mean of K blocks
    assert np.median(r.token_sd) == pytest.approx(np.hypot(0.05, 0.05) / np.sqrt(K), rel=0.25)


def drifting_layers(curve: np.ndarray, n: int, seed: int, jitter_sd: float = 0.03
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Token noise that drifts over checkpoints (each block a random walk: the same tokens
    read by a slowly changing model) plus independent checkpoint jitter."""
    rng = np.random.default_rng(seed)
    m = len(curve)
    blocks = (curve + np.cumsum(rng.normal(scale=0.03, size=(n, K, m)), axis=2)
              + rng.normal(scale=0.05, size=(n, K, 1)))
    return blocks.mean(axis=1) + rng.normal(scale=jitter_sd, size=(n, m)), blocks


def test_drifting_token_noise_plus_jitter_keeps_its_power_and_level() -> None:
    """The surrogates mix the two noises as the data does. With drifting token noise the
    blocks alone look smooth, so surrogates made of them alone would drop far relative to
    their roughness: a 30 % fall was found in under a fifth of layers that way. With the
    jitter term: ≥ 85 % of such falls, ≤ 5 % of saturating layers."""
    x, blocks = drifting_layers(rise_then_fall(0.3), 400, seed=21)
    assert regime_share(regime_calls(x, blocks).call) >= 0.85
    x, blocks = drifting_layers(saturating(100), 400, seed=22)
    assert regime_share(regime_calls(x, blocks).call) <= 0.05


def test_roughness_is_the_noise_variance_around_a_smooth_trend() -> None:
    rng = np.random.default_rng(0)
    x = saturating(300) + rng.normal(scale=0.2, size=(4000, len(T)))
    assert np.median(roughness(x)) == pytest.approx(0.04, rel=0.15)


def test_a_gain_within_noise_has_no_share_lost() -> None:
    """The share of the gain lost is only reported where the rise is significant: a
    gain of almost nothing would make it arbitrarily large (the old rule reported 1e3+)."""
    x, blocks = layers(np.zeros(len(T)), 400, seed=5, jitter_sd=0.05)
    r = regime_calls(x, blocks)
    ok = np.isfinite(r.share_lost)
    assert (r.p_rise[ok] < 0.05).all()
    assert np.isnan(r.share_lost[r.p_rise >= 0.05]).all()
    assert np.nanmax(np.abs(r.share_lost)) < 20


def test_a_row_gets_the_same_answer_alone_or_in_a_batch() -> None:
    x, blocks = layers(rise_then_fall(0.3), 5, seed=2, jitter_sd=0.03)
    batch = regime_calls(x, blocks)
    for i in range(5):
        one = regime_calls(x[i:i + 1], blocks[i:i + 1])
        assert one.p_fall[0] == batch.p_fall[i] and one.call[0] == batch.call[i]


# --- through the tables: warm-up, blocks, bootstrap --------------------------------------------


def _frames(series: dict[int, np.ndarray], seed: int, jitter_sd: float = 0.03,
            bias: float = 0.0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All-token rows and per-block rows of layer contrasts on every demo checkpoint
    (``bias``: every block reads this much above the all-token value, as PRs measured on
    fewer tokens do)."""
    rows, brows = [], []
    for layer, curve in series.items():
        x, blocks = layers(curve, 1, seed + layer, jitter_sd=jitter_sd)
        for j, s in enumerate(STEPS):
            rows.append({"checkpoint": f"step{int(s)}", "step": s, "layer": layer, "head": -1,
                         "metric": "contrast_token_heads", "value": x[0, j], "block": -1,
                         "in_trends": True})
            brows += [{"checkpoint": f"step{int(s)}", "step": s, "layer": layer, "head": -1,
                       "metric": "contrast_token_heads", "value": blocks[0, b, j] + bias,
                       "block": b, "in_trends": True} for b in range(K)]
    return pd.DataFrame(rows), pd.DataFrame(brows)


def test_the_trend_table_reads_only_checkpoints_after_the_warm_up() -> None:
    """A layer that rises and falls inside the warm-up and then rises and levels off is a
    monotone rise after it; the warm-up checkpoints are counted apart."""
    early = np.where(STEPS <= 16, STEPS / 16, np.where(STEPS < WARMUP, 0.0, 0.0))
    curve = early + np.where(STEPS >= WARMUP, saturating(200, STEPS), 0.0) * 2
    metrics, blocks = _frames({0: curve, 1: np.concatenate([np.zeros(8), rise_then_fall(0.5)
                                                            * 2])}, seed=1)
    t = trend_table(metrics, blocks, WARMUP).set_index("layer")
    assert (t["n"] == 15).all() and (t["n_warmup"] == 8).all()
    assert t.loc[0, "call"] == MONOTONE and t.loc[0, "first_step"] == 128
    assert t.loc[1, "call"] == RISE_FALL
    whole = trend_table(metrics, blocks, None).set_index("layer")  # warm-up unknown
    assert (whole["n"] == 23).all() and (whole["n_warmup"] == 0).all()


def test_the_bootstrap_resamples_around_the_all_token_estimate() -> None:
    """Blocks that read 0.5 above the all-token value (a PR on fewer tokens is biased) do
    not move the band: it is centred on the all-token trajectory. The old bootstrap
    averaged the drawn blocks, so its band sat 0.5 too high and missed the estimate."""
    curve = rise_then_fall(0.5, STEPS, top=400.0)
    metrics, blocks = _frames({0: curve}, seed=4, bias=0.5)
    per_layer, band = block_bootstrap(metrics, blocks, WARMUP, n_boot=400)
    x = metrics.sort_values("step")["value"].to_numpy()
    b = band.sort_values("step")
    assert (b["low"].to_numpy() <= x + 1e-12).all() and (x <= b["high"].to_numpy() + 1e-12).all()
    mid = (b["low"] + b["high"]).to_numpy() / 2
    assert np.abs(mid - x).max() < 0.1  # centred: nowhere near the blocks' +0.5
    r = per_layer.iloc[0]
    assert r["share_rise_then_fall"] > 0.8 and r["n_boot"] == 400
    estimate = trend_table(metrics, blocks, WARMUP)["share_lost"].iloc[0]
    assert r["share_lost_low"] < estimate < r["share_lost_high"]  # around the estimate
    again, _ = block_bootstrap(metrics, blocks, WARMUP, n_boot=400)
    pd.testing.assert_frame_equal(per_layer, again)  # fixed seed


# --- the seed is the unit ------------------------------------------------------------------


def _seed_trends(curves: list[np.ndarray], seed: int, jitter_sd: float = 0.03) -> pd.DataFrame:
    """A trends table (primary contrast) of one seed's layers, from the real rule."""
    rows = []
    for layer, curve in enumerate(curves):
        x, blocks = layers(curve, 1, 100 * seed + layer, jitter_sd=jitter_sd)
        r = regime_calls(x, blocks)
        rows.append({"metric": "contrast_token_heads", "level": "token_heads", "layer": layer,
                     "n": len(T), **{k: v[0] for k, v in r.arrays().items()}})
    return pd.DataFrame(rows)


NO_HEADS = pd.DataFrame(columns=["checkpoint", "step", "level", "layer", "n_heads", "rho", "p"])


def _claims(curves: list[np.ndarray], seeds: int, start: int = 0) -> pd.DataFrame:
    units = {f"seed-{s}": (_seed_trends(curves, s), NO_HEADS) for s in range(start,
                                                                             start + seeds)}
    return seed_claims(units).set_index(["claim_id", "level"])


def test_over_seeds_a_regime_in_every_seed_is_supported_with_n_seeds() -> None:
    """One layer of four rises then falls in every seed: E4.1 (some layer falls) and E4.2
    (some layer rises then falls) are supported over 5 seeds, E4.3 (the layers taken
    together) is not; when every layer does, E4.3 is too."""
    claims = _claims([rise_then_fall(0.4), saturating(300), saturating(100), saturating(30)],
                     seeds=5)
    for cid in ("E4.1", "E4.2"):
        row = claims.loc[(cid, "token_heads")]
        assert (row["k"], row["n"]) == (5, 5)  # the unit is the seed, not its 4 layers
        assert row["p_value"] == pytest.approx(1 / 32) and row["verdict"] == "supported"
        assert "1/4, 1/4" in row["beside"]  # the layer counts per seed, shown beside
    assert claims.loc[("E4.3", "token_heads"), "verdict"] != "supported"
    every = _claims([rise_then_fall(0.4), rise_then_fall(0.3), rise_then_fall(0.5),
                     rise_then_fall(0.6)], seeds=5)
    assert every.loc[("E4.3", "token_heads"), "verdict"] == "supported"


def test_over_seeds_saturating_models_are_never_supported() -> None:
    """40 simulated 5-seed sets of saturating 4-layer models: no E4.1–E4.3 verdict is
    'supported' in more than the nominal 5 % (here: none)."""
    curves = [saturating(30), saturating(100), saturating(300), saturating(100) * 0.2]
    supported = {cid: 0 for cid in ("E4.1", "E4.2", "E4.3")}
    for rep in range(40):
        claims = _claims(curves, seeds=5, start=5 * rep)
        for cid in supported:
            supported[cid] += claims.loc[(cid, "token_heads"), "verdict"] == "supported"
    assert max(supported.values()) <= 2  # ≤ 5 % of 40


def test_three_seeds_can_only_describe() -> None:
    claims = _claims([rise_then_fall(0.5)] * 4, seeds=3)
    row = claims.loc[("E4.2", "token_heads")]
    assert (row["k"], row["n"]) == (3, 3) and row["p_value"] == pytest.approx(1 / 8)
    assert row["verdict"] == "inconclusive"


def test_one_model_is_decided_by_its_own_sidak_adjusted_p() -> None:
    t = _seed_trends([rise_then_fall(0.5), saturating(300), saturating(100)], seed=0)
    claims = e4_claims(t, NO_HEADS).set_index(["claim_id", "level"])
    e41 = claims.loc[("E4.1", "token_heads")]
    p_min = t["p_fall"].min()
    assert e41["p_value"] == pytest.approx(1 - (1 - p_min) ** 3)
    assert (e41["k"], e41["n"], e41["verdict"]) == (1, 1, "supported")  # the model: 1 unit
    assert e41["measured"] == "1/3 layers fall"
    none = e4_claims(_seed_trends([saturating(300)] * 3, seed=1), NO_HEADS)
    assert none.set_index(["claim_id", "level"]).loc[("E4.2", "token_heads"),
                                                      "verdict"] == "inconclusive"


# --- a random walk within each run (protocol 2) ----------------------------------------------

SETS, SEEDS, LAYERS = 200, 5, 4
NULL_SURROGATES = 199  # enough for a level of 0.05 (p ≥ 1/200); the reports use 1 999


def walking_sets(curves: list[np.ndarray], sets: int, seed: int, jitter_sd: float = 0.03,
                 walk_sd: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(x (sets, seeds, layers, m), blocks (sets, seeds, layers, K, m))``: every seed's
    layer l follows ``curves[l]`` plus token blocks, checkpoint jitter and a random walk of
    step ``walk_sd`` within its run (one step per checkpoint, its own walk in every run)."""
    rng = np.random.default_rng(seed)
    m = len(T)
    shape = (sets, SEEDS, LAYERS)
    curve = np.stack(curves)[None, None]
    blocks = (curve[..., None, :] + rng.normal(scale=0.05, size=(*shape, K, m))
              + rng.normal(scale=0.05, size=(*shape, K, 1)))
    x = (blocks.mean(axis=3) + rng.normal(scale=jitter_sd, size=(*shape, m))
         + np.cumsum(rng.normal(scale=walk_sd, size=(*shape, m)), axis=-1))
    return x, blocks


def set_calls(x: np.ndarray, blocks: np.ndarray, drift: bool = True):
    """The real rule on every set: the walk's step variance per set and layer from its
    seeds (:func:`drift_variance`, as ``qkgeom report`` does on an E4 set), then the regime
    call of every seed's layer (:class:`Regime` over sets × seeds × layers rows)."""
    sets = x.shape[0]
    q = np.zeros((sets, SEEDS, LAYERS))
    if drift:
        for s in range(sets):
            for layer in range(LAYERS):
                dev = token_deviations(blocks[s, :, layer], SEEDS, len(T))
                q[s, :, layer] = drift_variance(x[s, :, layer], dev)
    return regime_calls(x.reshape(-1, len(T)), blocks.reshape(-1, K, len(T)),
                        n_surrogates=NULL_SURROGATES, drift=q.ravel())


def set_verdicts(x: np.ndarray, blocks: np.ndarray, drift: bool = True) -> pd.DataFrame:
    """Each set's primary E4.1/E4.2 verdicts: the seeds' scores (:func:`seed_scores`, as
    :func:`seed_claims` computes them) and the verdict rule over the seeds (the sign-flip
    test; a primary row is decided at α). One row per set and claim: ``verdict``."""
    r = set_calls(x, blocks, drift)
    shape = (x.shape[0], SEEDS, LAYERS)
    scores = seed_scores(r.z_rise.reshape(shape), r.z_fall.reshape(shape))
    rows = []
    for cid, key in (("E4.1", "s1"), ("E4.2", "s2")):
        for s, values in enumerate(scores[key]):
            u = stats.unit_test(values, +1)
            rows.append({"set": s, "claim_id": cid,
                         "verdict": stats.verdict(u["k"], u["n"], u["p_value"])})
    return pd.DataFrame(rows)


def claims_of_sets(x: np.ndarray, blocks: np.ndarray) -> pd.DataFrame:
    """Every set's primary rows through :func:`seed_claims` itself (one row per set and
    claim: ``verdict``)."""
    r = set_calls(x, blocks)
    per_row = pd.DataFrame(r.arrays()).assign(
        metric="contrast_token_heads", level="token_heads", n=len(T),
        layer=np.tile(np.arange(LAYERS), x.shape[0] * SEEDS))
    rows = []
    for s in range(x.shape[0]):
        units = {f"seed-{i}": (per_row.iloc[(s * SEEDS + i) * LAYERS:
                                            (s * SEEDS + i + 1) * LAYERS], NO_HEADS)
                 for i in range(SEEDS)}
        claims = seed_claims(units)
        claims = claims[claims["role"] == "primary"]
        rows += [{"set": s, "claim_id": c, "verdict": v}
                 for c, v in zip(claims["claim_id"], claims["verdict"], strict=True)]
    return pd.DataFrame(rows)


def share(verdicts: pd.DataFrame, claim_id: str, verdict: str) -> float:
    sel = verdicts[verdicts["claim_id"] == claim_id]
    return float((sel["verdict"] == verdict).mean())


#: The null tests' bound: the nominal level plus 3 standard errors of a share over SETS
BOUND = 0.05 + 3 * np.sqrt(0.05 * 0.95 / SETS)


def test_the_walk_step_variance_is_recovered_across_seeds() -> None:
    """A random walk of step 0.03 plus jitter 0.03 and token noise, any shared curve: the
    residuals from the seeds' mean give the walk's step variance back (median over 400
    layers of 5 seeds), and no walk where there is none."""
    for walk, curve in ((0.03, rise_then_fall(0.3)), (0.0, saturating(100))):
        x, blocks = walking_sets([curve] * LAYERS, 100, seed=3, walk_sd=walk)
        q = [drift_variance(x[s, :, la], token_deviations(blocks[s, :, la], SEEDS, len(T)))
             for s in range(100) for la in range(LAYERS)]
        assert np.sqrt(np.median(q)) == pytest.approx(walk, abs=0.006)
    assert drift_variance(x[0, :2, 0]) == 0.0  # 2 seeds: too few to tell a walk


@pytest.mark.parametrize("curve", ["flat", "saturating"])
def test_over_seeds_a_slow_walk_within_each_run_is_not_a_regime(curve: str) -> None:
    """Issue 36: a random walk within each run (step 1 × the jitter) on a flat or a
    saturating curve. Surrogates without the walk called E4.1 supported in 45 % (flat) and
    22 % (saturating) of 5-seed sets; with the walk estimated across seeds, E4.1 and E4.2
    are supported in at most the nominal share (0.05 + 3 standard errors) of 200 sets."""
    curves = ([np.zeros(len(T))] * LAYERS if curve == "flat" else
              [saturating(30), saturating(100), saturating(300), saturating(100) * 0.2])
    x, blocks = walking_sets(curves, SETS, seed=31 if curve == "flat" else 32, walk_sd=0.03)
    verdicts = set_verdicts(x, blocks)
    for cid in ("E4.1", "E4.2"):
        assert share(verdicts, cid, "supported") <= BOUND, cid
    if curve == "flat":  # the test can fail: without the walk the level is far off
        assert share(set_verdicts(x, blocks, drift=False), "E4.1", "supported") > 0.2


def test_flat_data_never_read_not_supported_for_e4_2_and_e4_3() -> None:
    """Issue 36: the regime scores join two tests and are negative at a constant curve, so
    flat data gave E4.2/E4.3 *not supported* in 32–42 % of sets. Through seed_claims, the
    opposite direction is not read for them: at most the nominal share (here none) of 30
    flat sets, whose mean E4.3 score is negative all the same."""
    x, blocks = walking_sets([np.zeros(len(T))] * LAYERS, 30, seed=33)
    verdicts = claims_of_sets(x, blocks)
    for cid in ("E4.2", "E4.3"):
        assert share(verdicts, cid, "not supported") <= 0.05, cid
    r = set_calls(x, blocks)
    assert np.mean(seed_scores(r.z_rise, r.z_fall)["s3"]) < -0.2  # biased: why not read


def test_a_regime_shared_by_the_seeds_keeps_its_power_with_the_walk_estimated() -> None:
    """The walk is estimated from what the seeds do not share, so a rise and fall they all
    show is not taken for drift: one layer of four rising and losing 30 % of its gain in
    every seed (jitter 0.03, no walk) still supports E4.1 and E4.2 in ≥ 90 % of 40 sets."""
    curves = [rise_then_fall(0.3), saturating(300), saturating(100), saturating(30)]
    x, blocks = walking_sets(curves, 40, seed=34)
    verdicts = set_verdicts(x, blocks)
    for cid in ("E4.1", "E4.2"):
        assert share(verdicts, cid, "supported") >= 0.9, cid


def test_a_set_reads_the_walk_from_its_seeds_and_shows_a_warm_up_peak() -> None:
    """Through the tables, as ``qkgeom report`` reads an E4 set: the walk's step variance
    per contrast and layer from the seeds' frames (:func:`drift_over_seeds`), handed to each
    seed's trend table (``drift_sd``); a layer that peaks inside the warm-up and then falls
    is called a fall, never a regime, with its warm-up peak beside the call."""
    early_peak = np.where(STEPS <= 32, STEPS / 32, 1.0 - (STEPS - 32) / 300)
    rng = np.random.default_rng(8)
    units = []
    for seed in range(SEEDS):
        walk = np.concatenate([np.zeros(8), np.cumsum(rng.normal(scale=0.03, size=15))])
        metrics, blocks = _frames({0: early_peak + walk, 1: saturating(300, STEPS)},
                                  seed=10 * seed)
        units.append((metrics, blocks, WARMUP))
    drift = drift_over_seeds(units)
    assert set(drift) == {("contrast_token_heads", 0), ("contrast_token_heads", 1)}
    assert np.sqrt(drift[("contrast_token_heads", 0)]) == pytest.approx(0.03, abs=0.015)
    t = trend_table(*units[0], drift=drift).set_index("layer")
    assert t.loc[0, "drift_sd"] == pytest.approx(np.sqrt(drift[("contrast_token_heads", 0)]))
    assert t.loc[0, "call"] != RISE_FALL and t.loc[0, "warmup_peak_step"] == 32
    assert t.loc[0, "warmup_excess"] > 0.2 and t.loc[0, "warmup_excess_z"] > 3
    assert (trend_table(*units[0])["drift_sd"] == 0).all()  # one model: no walk
