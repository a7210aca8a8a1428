"""Attack 10: distributed use. Under ``torch.distributed`` only rank 0's monitor writes (the
other ranks probe and write nothing; without that, two ranks would write one folder); a
local Ray instance qkgeom starts listens on 127.0.0.1 only; ``--retries`` lets Ray restart
a run whose worker died, and the retry resumes from the run's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import assert_same_results, figure, train_in_process

RESULTS: dict[str, bool] = {}


def _rank_main(rank: int, store: str, out: str, result: str) -> None:
    """One DDP rank: a gloo group of 2, a GeometryMonitor on the same folder on both."""
    import torch
    import torch.distributed as dist

    from qkgeom.config import GPTConfig
    from qkgeom.model import GPT
    from qkgeom.monitor import GeometryMonitor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=11))
        ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
        mon = GeometryMonitor(model, ids, every=1, out=out, tensorboard=None, wandb=False)
        for step in range(3):
            mon.step(step)
            dist.barrier()  # both ranks probe each step before either goes on
        mon.close()
        Path(f"{result}.{rank}").write_text(json.dumps({
            "probes": len(mon.probes), "folder": mon.folder is not None}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_monitor_writes_only_on_rank_zero(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "mon"
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(out), str(tmp_path / "res")),
             nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"res.{r}").read_text()) for r in range(2)]
    assert [r["probes"] for r in ranks] == [3, 3]  # every rank measured
    assert [r["folder"] for r in ranks] == [True, False]  # only rank 0 wrote
    from qkgeom.runs import read_metrics, read_status

    assert sorted(read_metrics(out)["step"].unique()) == [0, 1, 2]
    assert read_status(out)["state"] == "done"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".mon")]
    assert (out / ".qkgeom-monitor.lock").is_file()  # rank 0's lock, inside its folder
    RESULTS["monitor under DDP (2 ranks)"] = True


_RAY_SCRIPT = """
import dataclasses, json, sys, psutil
from qkgeom.experiments.backends import RayBackend
from qkgeom.experiments.grid import Grid
from qkgeom.experiments.runner import resolve_data

run_dir, grid = sys.argv[1], json.loads(sys.argv[2])
spec = resolve_data(Grid.from_dict(grid).expand())[0]
backend = RayBackend(None, retries=1)
import ray

listening = sorted({c.laddr.ip for p in psutil.Process().children(recursive=True)
                    for c in p.net_connections(kind="inet") if c.status == "LISTEN"})
report = {"node_ip": ray.util.get_node_ip_address(),
          "nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "listening": listening}
from pathlib import Path
backend.submit(Path(run_dir), dataclasses.replace(spec.config, threads=1).to_dict(), 1, False)
results = []
while not results:
    results = backend.wait(5.0)
backend.close()
report["result"] = results[0]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_local_ray_listens_on_loopback_and_retries_resume(sample_data: Path,
                                                           tmp_path: Path) -> None:
    pytest.importorskip("ray")
    base = {"data": str(sample_data), "steps": 12, "checkpoint_every": 4, "probe_every": 4,
            "eval_every": 4, "log_every": 4, "warmup_steps": 2}
    grid = {"name": "ray", "preset": "smoke", "base": base}
    run = tmp_path / "runs" / "base"
    once = tmp_path / "fault-fired"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # HOME: Ray keeps the token of a local instance in ~/.ray; never the user's own one.
    env.update(QKGEOM_FAULT="kill:ckpt_*.pt:2", QKGEOM_FAULT_ONCE=str(once),
               RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", _RAY_SCRIPT, str(run), json.dumps(grid)],
                         capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["node_ip"] == "127.0.0.1" and report["nodes"] == ["127.0.0.1"]
    assert report["listening"] and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1")
                                       for ip in report["listening"]), report["listening"]
    RESULTS["local Ray on loopback only"] = True
    assert once.exists()  # the worker really was killed half-way through a checkpoint
    assert report["result"]["state"] == "done", report["result"]
    attempts = [json.loads(x) for x in (run / "attempts.jsonl").read_text().splitlines()]
    assert [a["resume_from"] for a in attempts] == [None, 4]  # the retry resumed
    assert_same_results(train_in_process(sample_data, tmp_path / "ref", 12, 4), run)
    RESULTS["Ray task retried after its worker died"] = True
    figure("distributed", f"{sum(RESULTS.values())}/{len(RESULTS)} cases handled cleanly "
           f"({'; '.join(RESULTS)})")
