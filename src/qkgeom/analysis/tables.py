"""The per-layer geometry table that ``qkgeom show``, ``train`` and ``analyze`` print.

Reads only the long-format metrics table (no torch), so it works on any run folder,
finished or still training.
"""

from __future__ import annotations

import pandas as pd

# (metric, column title) in display order.
COLUMNS = [
    ("pr_q_weight", "PR_Q w"), ("pr_k_weight", "PR_K w"), ("contrast_weight", "contrast w"),
    ("pr_q_token", "PR_Q tok"), ("pr_k_token", "PR_K tok"), ("contrast_token", "contrast tok"),
    ("pr_qk_weight", "pr_qk w"), ("pr_qk_token", "pr_qk tok"),
    ("attn_entropy", "entropy"), ("attn_entropy_norm", "entropy norm"),
]


def layer_table(metrics: pd.DataFrame, step: int | None = None,
                reference_step: int | None = None) -> tuple[int, pd.DataFrame]:
    """Per-layer (head -1) values at ``step`` (default: the last probe), plus the change of
    token-level PR_Q and PR_K since step 0 and since the post-transient reference step
    (the first probe at or after ``reference_step``). Returns (step, table). Rows of token
    blocks (an analysis folder's ``block`` ≥ 0) are left out: the table is of all tokens."""
    if "block" in metrics:
        metrics = metrics[metrics["block"] < 0]
    if metrics.empty:
        raise ValueError("no probe records yet")
    steps = sorted(int(s) for s in metrics["step"].unique())
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"no probe at step {step}; probed steps: {', '.join(map(str, steps))}")
    layer = metrics[metrics["head"] == -1]

    def wide(s: int) -> pd.DataFrame:
        return layer[layer["step"] == s].pivot_table(index="layer", columns="metric",
                                                     values="value")

    now = wide(step)
    table = pd.DataFrame(index=now.index)
    for metric, title in COLUMNS:
        if metric in now:
            table[title] = now[metric]
    refs = [(steps[0], "@0")]
    if reference_step is not None:
        later = [s for s in steps if s >= reference_step]
        if later and later[0] not in (steps[0], step):
            refs.append((later[0], f"@{later[0]}"))
    for ref, tag in refs:
        base = wide(ref)
        for metric, title in (("pr_q_token", "ΔPR_Q tok"), ("pr_k_token", "ΔPR_K tok")):
            if metric in now and metric in base:
                table[f"{title}{tag}"] = now[metric] - base[metric]
    return step, table
