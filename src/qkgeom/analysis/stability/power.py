"""What the sweep's design could resolve (docs/stability.md#seeds-and-power): per primary
claim row, the paired SD it measured, the power of its seeds at the effect that matters and
the seeds 80 % would need. Descriptive: it changes no verdict. The SD is that of the
row's unit values (``sd`` of :func:`~qkgeom.analysis.stability.claims.stability_claims`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.stability.claims import DELTA_LOSS

EFFECT_NATS = 0.1  # S1 and S3: the smallest gain that matters
POWER_COLUMNS = ["claim_id", "arm", "level", "n", "sd", "effect", "power", "seeds_for_80"]


def power_table(claims: pd.DataFrame) -> pd.DataFrame:
    """:data:`POWER_COLUMNS` per primary row with units: S1 and S3 the one-sided t-test's
    power at :data:`EFFECT_NATS`, S2 the TOST's at a true difference of 0 within ±δ."""
    rows = []
    prim = claims[(claims["role"] == "primary") & (claims["n"] > 0)] if len(claims) else claims
    for r in prim.itertuples():
        n, sd = int(r.n), float(r.sd)
        equiv = r.claim_id == "S2"
        effect = DELTA_LOSS if equiv else EFFECT_NATS
        if equiv:
            power = stats.equivalence_power(sd, n, effect)
        else:
            power = stats.effect_power(sd, n, effect)
        try:
            need = (stats.seeds_for_power(sd, effect, kind="equivalence" if equiv else "effect")
                    if np.isfinite(sd) and sd > 0 else np.nan)
        except ValueError:  # beyond 10 000 seeds
            need = np.nan
        rows.append({"claim_id": r.claim_id, "arm": r.arm, "level": r.level, "n": n, "sd": sd,
                     "effect": effect, "power": power, "seeds_for_80": need})
    return pd.DataFrame(rows, columns=POWER_COLUMNS)
