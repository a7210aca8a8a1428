"""E3 pairing over a grid with two depths: a run is compared only with the none run of
its own depth and seed (issue 40: pairing that ignored ``model.n_layer`` passed every
other test)."""

from __future__ import annotations

from pathlib import Path

from qkgeom.analysis import collate
from qkgeom.analysis.e3 import pair_groups, run_arms

from .conftest import monotone_values, write_run, write_sweep

ARMS = {"none": {"mode": "none", "record": True}, "hold-token-data": {"mode": "hold"},
        "shrink-0.5-token-data": {"mode": "shrink", "dose": 0.5}}


def test_runs_of_two_depths_of_one_seed_are_never_paired(tmp_path: Path) -> None:
    root = tmp_path / "depths"
    runs = []
    for depth in (4, 6):
        for seed in (0, 1):
            for arm, kc in ARMS.items():
                rid = f"n_layer={depth},seed={seed},arm={arm}"
                write_run(root, rid, depth, "normal", seed, monotone_values(),
                          extra_cfg={"key_control": kc})
                runs.append({"run_id": rid, "axes": {"model.n_layer": depth, "seed": seed}})
    write_sweep(root, runs, {"model.n_layer": [4, 6], "seed": [0, 1]})
    members, excluded = pair_groups(run_arms(collate(root)))
    assert excluded.empty, excluded.to_dict("records")
    assert members["group"].nunique() == 4  # depth x seed
    assert len(members) == len(runs)
    for _, group in members.groupby("group"):
        depth = {rid.split(",")[0] for rid in group["run_id"]}
        assert len(depth) == 1 and group["seed"].nunique() == 1, group["run_id"].tolist()
        base = group.loc[group["arm"] == "none", "run_id"].item()
        assert base.startswith(depth.pop()) and set(group["baseline"]) == {base}
