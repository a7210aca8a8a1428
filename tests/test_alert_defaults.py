"""The default alert rules read only quantities that do not scale with the model's width:
on one recorded run whose attention collapses, the defaults make the same calls when every
scale-dependent metric is rescaled as a wider model's would be, where protocol 1's absolute
thresholds do not (docs/stability.md#alerts)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qkgeom.alerts import DEFAULT_RULES, Alert, entropy_collapse, logit_growth, logit_jump, replay

#: Metrics in logit or norm units: a wider model's logits (or q/k norms) run at another scale.
SCALED = ("logit_max", "logit_bound", "logit_delta", "logit_std", "logit_std_row",
          "q_norm_max", "k_norm_max")
PROTOCOL1 = (logit_growth(74.0), logit_jump(8.8), entropy_collapse(0.59))


@pytest.fixture(scope="module")
def collapsing(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """A tiny GPT trained hard (lr 0.1) on a text it can copy, so attention goes one-hot,
    under a monitor recording every metric every 2 steps; its metrics.parquet."""
    import torch

    from qkgeom import GPT, GPTConfig
    from qkgeom.monitor import GeometryMonitor
    from qkgeom.runs import read_metrics

    vocab, T, steps = 32, 16, 30
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=vocab))
    probe = torch.randint(0, vocab, (4, T), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    out = tmp_path_factory.mktemp("collapsing") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.warns(Warning), GeometryMonitor(
                model, probe, every=2, out=out, tensorboard=None, wandb=False,
                metrics="all") as mon:
            mon.start(0, total_steps=steps)
            for step in range(steps):
                x = torch.randint(0, vocab, (8, T), generator=gen)
                x[:, 1:] = x[:, :1]  # every position repeats the first token
                logits, _ = model(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab)[:-1],
                                                         x.reshape(-1)[1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step(step + 1, loss=loss)
    finally:
        torch.set_num_threads(threads)
    return read_metrics(Path(out))


def _calls(alerts: list[Alert]) -> list[tuple[str, int, int, int]]:
    return [(a.rule, a.step, a.layer, a.head) for a in alerts]


@pytest.mark.parametrize("factor", [0.25, 4.0, 16.0])
def test_the_defaults_make_the_same_calls_on_a_run_rescaled_to_another_width(
        collapsing: pd.DataFrame, factor: float) -> None:
    wider = collapsing.copy()
    scaled = wider["metric"].isin(SCALED)
    assert scaled.any()
    wider.loc[scaled, "value"] *= factor
    calls = _calls(replay(collapsing, DEFAULT_RULES))
    assert calls, "the defaults fire on this collapsing run (not vacuous)"
    assert _calls(replay(wider, DEFAULT_RULES)) == calls
    # absolute thresholds are not scale-free: the same rescale changes their calls
    assert _calls(replay(wider, PROTOCOL1)) != _calls(replay(collapsing, PROTOCOL1))
