"""A resumed monitor is the run it continues: its alerts.json keeps the earlier attempt's
alerts, and its rules (relative baselines, conditions already holding, growth rates) go on
from the recorded probes, so stop + resume fires exactly what an uninterrupted run fires.
Also its status between probes (the heartbeat)."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from qkgeom import GPT, GPTConfig
from qkgeom.alerts import AlertRule, logit_rate
from qkgeom.data import sample_batch
from qkgeom.monitor import GeometryMonitor

STEPS, EVERY, STOP = 16, 2, 14
#: Rules each of which a fresh state gets wrong after a resume at STOP: a relative baseline
#: (step 0's key PR), a condition already holding at STOP (no second alert), a growth rate
#: (the previous probe's value); on this run each fires before STOP, and the rate after it.
RULES = [AlertRule("keys fell to a fifth", "pr_k_token", below=0.2, relative=True),
         AlertRule("entropy under 2.2", "attn_entropy", below=2.2),
         logit_rate(0.31)]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one torch thread is the fastest on a shared machine (and both runs of a
    comparison use the same count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(corpus) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32,
                         vocab_size=corpus.vocab.vocab_size))


def _monitor(model: GPT, probe, out: Path, resume: bool = False) -> GeometryMonitor:
    return GeometryMonitor(model, probe, every=EVERY, out=out, resume=resume, alerts=RULES,
                           metrics=["pr_k_token", "logit_max", "attn_entropy"],
                           tensorboard=None, wandb=False)


def _train(model, opt, gen, mon, corpus, steps: range) -> None:
    for step in steps:
        x, y = sample_batch(corpus.train, 8, 32, gen)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(step, loss=loss)


def _alerts(run: Path) -> list[dict]:
    return json.loads((run / "alerts.json").read_text())


def test_stop_and_resume_fires_what_an_uninterrupted_run_fires(corpus, tmp_path: Path) -> None:
    from qkgeom.data import probe_set

    probe = probe_set(corpus.val, 4, 32)
    warnings.simplefilter("ignore")  # GeometryWarning of every alert
    model = _model(corpus)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(0)
    whole = _monitor(model, probe, tmp_path / "whole")
    whole.start(0)
    _train(model, opt, gen, whole, corpus, range(1, STEPS + 1))
    whole.close()
    expected = _alerts(tmp_path / "whole")
    steps = [a["step"] for a in expected]
    assert min(steps) < STOP <= max(steps), steps  # alerts on both sides of the stop
    assert {a["rule"] for a in expected} == {r.name for r in RULES}

    model = _model(corpus)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(0)
    first = _monitor(model, probe, tmp_path / "cut")
    first.start(0)
    _train(model, opt, gen, first, corpus, range(1, STOP + 1))
    first.close("interrupted")  # stopped at STOP: what a checkpoint of the run holds
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), gen.get_state()))
    assert [a for a in _alerts(tmp_path / "cut") if a["step"] >= STOP]  # refired on resume

    model = _model(corpus)
    model.load_state_dict(saved[0])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    opt.load_state_dict(saved[1])
    gen = torch.Generator()
    gen.set_state(saved[2])
    again = _monitor(model, probe, tmp_path / "cut", resume=True)
    again.start(STOP)  # as the HF and Lightning callbacks do: the resumed step is probed again
    _train(model, opt, gen, again, corpus, range(STOP + 1, STEPS + 1))
    again.close()
    assert _alerts(tmp_path / "cut") == expected
    assert again.fired == whole.fired


def test_a_resume_from_an_earlier_step_keeps_the_alerts_before_it(corpus, tmp_path: Path
                                                                   ) -> None:
    """Resumed from a step behind the last probe (a checkpoint before the crash): the alerts
    before it are kept, those after it are not kept twice (they fire again if the run gets
    there again)."""
    from qkgeom.data import probe_set
    from qkgeom.runs import read_alerts

    probe = probe_set(corpus.val, 4, 32)
    warnings.simplefilter("ignore")
    rules = [AlertRule("always", "attn_entropy", above=0.0),
             AlertRule("from 4", "attn_entropy", above=0.0, from_step=4)]
    model = _model(corpus)
    mon = GeometryMonitor(model, probe, every=EVERY, out=tmp_path / "m", alerts=rules,
                          metrics=["attn_entropy"], tensorboard=None, wandb=False)
    mon.start(0)  # "always" fires at step 0 in both layers
    planted = [*read_alerts(tmp_path / "m"), {"rule": "always", "step": 8, "layer": 0}]
    (tmp_path / "m" / "alerts.json").write_text(json.dumps(planted))  # as if fired at 8
    mon.close("interrupted")
    again = GeometryMonitor(model, probe, every=EVERY, out=tmp_path / "m", alerts=rules,
                            metrics=["attn_entropy"], tensorboard=None, wandb=False,
                            resume=True)
    again.start(4)  # "always" holds still: silent; "from 4" fires in both layers
    again.close()
    assert [(a["rule"], a["step"]) for a in read_alerts(tmp_path / "m")] == [
        ("always", 0), ("always", 0), ("from 4", 4), ("from 4", 4)]


def test_the_monitor_writes_its_status_between_probes(corpus, tmp_path: Path) -> None:
    from qkgeom.data import probe_set
    from qkgeom.runs import read_status

    mon = GeometryMonitor(_model(corpus), probe_set(corpus.val, 4, 32), every=10,
                          out=tmp_path / "m", metrics=["pr_q_token"], tensorboard=None,
                          wandb=False)
    mon.start(0)
    mon.folder.heartbeat_s = 0.0  # every step past the interval
    mon.step(3)
    status = read_status(tmp_path / "m")
    assert status["step"] == 3 and "probe_s" in status  # no probe at 3: its status all the same
    mon.folder.heartbeat_s = 3600.0
    mon.step(4)
    assert read_status(tmp_path / "m")["step"] == 3
    mon.close()
