"""The monitor's demo: a monitored GPT-2 run, the closed loop on the demo GPT, a figure.

::

    python -m qkgeom.monitor.demo --out runs/monitor-demo --figure docs/figures/monitor-demo.png

An HF GPT-2 trained by a plain loop under a :class:`GeometryMonitor` (``<out>/gpt2``), and
the demo GPT trained twice from one init, uncontrolled and with the entropy closed loop
(``<out>/closed-loop``); docs/monitor.md shows and explains the figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

__all__ = ["DEMO_OVERRIDES", "closed_loop", "figure", "monitored_gpt2"]

# The E1/E3 demo's shape and schedule (qkgeom.experiments.e1), probed every 10 steps so
# the controller acts 30 times.
DEMO_OVERRIDES: dict[str, Any] = {
    "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "steps": 300, "batch_size": 16, "warmup_steps": 30, "probe_every": 10, "eval_every": 100,
    "eval_batches": 4, "checkpoint_every": 100, "seed": 0,
}


def _layer_metric(run: Path, metric: str) -> pd.DataFrame:
    m = pd.read_parquet(run / "metrics.parquet")
    sel = m[(m["metric"] == metric) & (m["head"] == -1) & (m["layer"] >= 0)]
    return sel.pivot_table(index="step", columns="layer", values="value")


def closed_loop(out: Path, *, target: float = 2.0, gain: float = 1.0, max_step: float = 0.25,
                tolerance: float = 0.1, threads: int = 1) -> pd.DataFrame:
    """Train ``none`` and ``controlled``; per layer: target, entropy reached, baseline."""
    from qkgeom.config import make_config
    from qkgeom.control.closed_loop import EntropyControlCallback, EntropyController
    from qkgeom.training import train

    cfg = make_config("small", {**DEMO_OVERRIDES, "threads": threads})
    for name, callbacks in (("none", []), ("controlled", [EntropyControlCallback(
            EntropyController(target, gain=gain, max_step=max_step))])):
        if not (out / name / "status.json").exists():
            train(cfg, out / name, callbacks=callbacks)
    ctl = _layer_metric(out / "controlled", "attn_entropy")
    base = _layer_metric(out / "none", "attn_entropy")
    rows = []
    for layer in ctl.columns:
        err = (ctl[layer] - target).abs()
        outside = err[err > tolerance]
        settled = int(outside.index.max()) + cfg.probe_every if len(outside) else 0
        rows.append({"layer": int(layer), "target": target,
                     "entropy_none": float(base[layer].iloc[-1]),
                     "entropy_controlled": float(ctl[layer].iloc[-1]),
                     "error": float(ctl[layer].iloc[-1] - target),
                     "reached": bool(err.iloc[-1] <= tolerance),
                     "within_tolerance_from_step": settled if settled <= cfg.steps else None})
    return pd.DataFrame(rows)


def monitored_gpt2(out: Path, *, steps: int = 300, every: int = 25, seed: int = 0) -> Path:
    """Train a character-level HF GPT-2 with a plain loop under a :class:`GeometryMonitor`."""
    if (out / "status.json").exists():
        return out
    import transformers

    from qkgeom.data import ensure_sample_data, load_prepared, probe_set, sample_batch
    from qkgeom.monitor import GeometryMonitor

    data = load_prepared(ensure_sample_data())
    T = 64
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=T,
                                  vocab_size=data.vocab.vocab_size, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    gen = torch.Generator().manual_seed(seed)
    mon = GeometryMonitor(model, probe_set(data.val, 16, T), every=every, out=out,
                          total_steps=steps, metrics="all")
    model.train()
    with mon:
        mon.start(0)
        for step in range(steps):
            x, _ = sample_batch(data.train, 16, T, gen)  # (16, T)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            mon.step(step + 1, loss=loss)
    return out


def figure(gpt2_run: Path, closed: Path, target: float, path: Path) -> Path:
    """Three panels: token PR_Q / PR_K and entropy of the monitored GPT-2, and the closed
    loop's entropy against the uncontrolled run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, 4))
    pr_q, pr_k = _layer_metric(gpt2_run, "pr_q_token"), _layer_metric(gpt2_run, "pr_k_token")
    ent = _layer_metric(gpt2_run, "attn_entropy")
    for i, layer in enumerate(pr_q.columns):
        axes[0].plot(pr_q.index, pr_q[layer], color=colors[i], label=f"layer {layer} PR_Q")
        axes[0].plot(pr_k.index, pr_k[layer], color=colors[i], ls="--", label=f"layer {layer} PR_K")
        axes[1].plot(ent.index, ent[layer], color=colors[i], label=f"layer {layer}")
    axes[0].set(yscale="log", xlabel="step", ylabel="token-level PR",
                title="monitored HF GPT-2: PR_Q (—), PR_K (--)")
    axes[0].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 2, 5, 10
    axes[0].yaxis.set_minor_formatter(NullFormatter())
    axes[1].set(xlabel="step", ylabel="attention entropy (nats)",
                title="monitored HF GPT-2: attention entropy")
    ctl, base = (_layer_metric(closed / n, "attn_entropy") for n in ("controlled", "none"))
    for i, layer in enumerate(ctl.columns):
        axes[2].plot(base.index, base[layer], color=colors[i], ls=":", alpha=0.8)
        axes[2].plot(ctl.index, ctl[layer], color=colors[i], label=f"layer {layer}")
    axes[2].axhline(target, color="black", lw=1, ls="--", label=f"target {target:g} nats")
    axes[2].set(xlabel="step", ylabel="attention entropy (nats)",
                title="closed loop, demo GPT: controlled (—), none (···)")
    axes[0].legend(fontsize=6, ncol=2)
    for ax in axes[1:]:
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/monitor-demo"))
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/monitor-demo.png"))
    parser.add_argument("--target", type=float, default=2.0, help="target entropy (nats)")
    parser.add_argument("--gain", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = closed_loop(args.out / "closed-loop", target=args.target, gain=args.gain,
                        threads=args.threads)
    print(table.to_string(index=False))
    gpt2 = monitored_gpt2(args.out / "gpt2")
    print(f"figure: {figure(gpt2, args.out / 'closed-loop', args.target, args.figure)}")


if __name__ == "__main__":
    main()
