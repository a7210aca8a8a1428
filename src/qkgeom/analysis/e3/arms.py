"""E3 arms and pair groups: which runs are compared with which (docs/protocols.md).

A run's arm is named from its config (:attr:`qkgeom.config.KeyControlConfig.arm`, the one
home of arm names). Runs pair when their configs agree on every key except the key
control (and how fast they ran): such a group shares init and data order, so it is one
independent unit (a seed), with exactly one ``none`` run as its baseline.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pandas as pd

from qkgeom.analysis.collate import Collated
from qkgeom.config import KeyControlConfig

BASELINE = "none"
SHAM = "sham"
ARM_COLUMNS = ["run_id", "seed", "arm", "mode", "dose", "level", "scope", "scale", "steps",
               "dir", "pair_key", "cell_key"]
CONTROL_PREFIX = "key_control."
#: How fast, not what: runs differing only in these (and the key control) pair.
EXECUTION = {"device", "threads", "compile"}


def config_digest(flat: dict[str, Any], leave_out: set[str]) -> str:
    """A short hash of a flattened config except ``key_control.*`` and ``leave_out``: runs
    with equal digests differ only in their key control (and in what was left out)."""
    kept = {k: v for k, v in flat.items()
            if k not in leave_out and not k.startswith(CONTROL_PREFIX)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_arms(data: Collated) -> pd.DataFrame:
    """One row per analysed (not excluded) run (:data:`ARM_COLUMNS`): its arm from its
    config, ``pair_key`` (equal for runs that differ only in their key control) and
    ``cell_key`` (equal also across seeds)."""
    rows = []
    for run in data.included.to_dict("records"):
        flat = run["config"]
        kc = KeyControlConfig(**{f: flat[CONTROL_PREFIX + f] for f in (
            "mode", "level", "scale", "dose", "scope") if CONTROL_PREFIX + f in flat})
        dose = float(kc.dose) if kc.mode in ("shrink", "expand") else 1.0
        rows.append({"run_id": run["run_id"], "seed": int(run["seed"]), "arm": kc.arm,
                     "mode": kc.mode, "dose": dose, "level": kc.level, "scope": kc.scope,
                     "scale": kc.scale, "steps": int(run.get("steps") or 0),
                     "dir": run["dir"], "pair_key": config_digest(flat, EXECUTION),
                     "cell_key": config_digest(flat, EXECUTION | {"seed"})})
    return pd.DataFrame(rows, columns=ARM_COLUMNS)


def pair_groups(arms: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(members, excluded)``. ``members``: the runs of every valid pair group that has a
    controlled arm, with ``group`` (an int) and ``baseline`` (the group's ``none`` run).
    ``excluded``: ``run_id, seed, arm, reason`` of the runs of groups (or arms) left out."""
    cols = [*ARM_COLUMNS, "group", "baseline"]
    ex_cols = ["run_id", "seed", "arm", "reason"]
    runs = arms.assign(group=arms.groupby("pair_key", sort=True).ngroup())
    none = runs["arm"] == BASELINE
    by_group = runs.groupby("group")
    n_none = by_group["arm"].transform(lambda a: int((a == BASELINE).sum()))
    n_ctl = by_group["arm"].transform("size") - n_none
    runs = runs[n_ctl > 0]  # an uncontrolled run with nothing to compare: not part of E3
    none, n_none = none[runs.index], n_none[runs.index]
    nones = runs[none].groupby("group")["run_id"].agg(lambda r: ", ".join(sorted(r)))
    reason = pd.Series("", index=runs.index, dtype=object)
    reason[n_none == 0] = "no uncontrolled (none) run with the same config to pair with"
    many = n_none > 1
    reason[many] = [f"{n} uncontrolled (none) runs with the same config: ambiguous baseline "
                    f"({nones[g]})" for n, g in zip(n_none[many], runs.loc[many, "group"],
                                                    strict=True)]
    dup = ~none & runs.duplicated(["group", "arm"], keep=False) & (reason == "")
    n_dup = runs[dup].groupby(["group", "arm"])["run_id"].transform("size")
    reason[dup] = [f"{n} runs of arm {a} with the same config"
                   for n, a in zip(n_dup, runs.loc[dup, "arm"], strict=True)]
    excluded = runs[reason != ""].assign(reason=reason[reason != ""])[ex_cols]
    valid = runs[(reason == "") & (n_none == 1)]
    base = valid[valid["arm"] == BASELINE].set_index("group")["run_id"]
    members = valid.assign(baseline=valid["group"].map(base))
    members = members[members["group"].isin(members.loc[members["arm"] != BASELINE, "group"])]
    return members[cols].reset_index(drop=True), excluded.reset_index(drop=True)


def is_e3(data: Collated) -> bool:
    """True when some pair group of the analysed runs holds an uncontrolled and a controlled
    run (whether or not the group is then usable): the folder gets the E3 report."""
    arms = run_arms(data)
    if arms.empty:
        return False
    has = arms.groupby("pair_key")["arm"].agg(
        lambda a: BASELINE in set(a) and bool((a != BASELINE).any()))
    return bool(has.any())
