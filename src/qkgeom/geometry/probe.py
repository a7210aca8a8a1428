"""Probe the project's GPT: every SPEC §2 metric, per head and per layer, as a long table.

The one module of ``geometry/`` that knows a model; the rest takes plain tensors.

The probe runs the fixed probe set through the model in eval mode and float32 (whatever
the training precision), taps q and k of every layer, and streams them into the geometry
accumulators, so memory does not grow with the probe set. Train mode is restored after.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from qkgeom.geometry import TokenGeometry, records_to_frame, weight_records
from qkgeom.model import GPT, tap_qk


@torch.no_grad()
def probe(model: GPT, tokens: Tensor, *, batch_size: int = 8, **columns: object) -> pd.DataFrame:
    """Measure Q/K geometry of ``model`` on ``tokens`` (n_seq, T).

    Returns the long format ``layer, head, metric, value`` (head -1 = whole layer) plus any
    constant ``columns`` given (e.g. ``run_id=..., step=...``).
    """
    cfg = model.config
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    acc = {layer: TokenGeometry(cfg.n_head, cfg.head_dim, causal=True)
           for layer in range(cfg.n_layer)}

    def on_qk(layer: int, q: Tensor, k: Tensor) -> None:
        acc[layer].update(q.float(), k.float())  # (B, nh, T, hs)

    try:
        with tap_qk(model, on_qk), torch.autocast(device.type, enabled=False):
            for chunk in tokens.split(batch_size):
                model(chunk.to(device))
    finally:
        model.train(was_training)
    records = {
        layer: weight_records(*(w.detach().float() for w in model.qk_weights(layer)), cfg.n_head)
        + acc[layer].records()
        for layer in range(cfg.n_layer)
    }
    return records_to_frame(records, **columns)
