"""One probe of a live model: SPEC §2 metrics per layer and head, and the key spectra.

Reuses the checkpoint-analysis machinery (:mod:`qkgeom.pretrained`) so a monitored run,
a training run of the project's GPT and a pretrained checkpoint report the same numbers:
:func:`~qkgeom.pretrained.adapters.find_attention_sites` knows where q/k live,
:func:`~qkgeom.pretrained.adapters.capture_qk` hands them over during one forward pass
over the fixed probe set, :class:`~qkgeom.pretrained.accumulate.LayerGeometry` streams
them into the token metrics (GQA-aware) and
:func:`~qkgeom.pretrained.analyze.model_weight_records` reads the weight metrics. The
forward runs on the base model (no LM head), in eval mode, without gradients or autocast,
inside :func:`~qkgeom.monitor.state.frozen_training_state`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import Tensor, nn

from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES, TOKEN_METRICS, WEIGHT_METRICS, records_to_frame
from qkgeom.monitor.state import frozen_training_state
from qkgeom.pretrained.accumulate import LayerGeometry
from qkgeom.pretrained.adapters import ModelAdapter, capture_qk
from qkgeom.pretrained.analyze import model_weight_records

__all__ = ["DEFAULT_METRICS", "Probe", "measure", "resolve_metrics"]

# The default: the paired token-level PRs and their contrast, the interaction PR of
# the weights, and attention entropy (what the closed loop and the alerts read).
DEFAULT_METRICS = ("pr_q_token", "pr_k_token", "contrast_token", "pr_qk_weight", "attn_entropy")
_ALIASES = {"contrast": "contrast_token"}


def resolve_metrics(metrics: str | Iterable[str]) -> tuple[str, ...]:
    """Canonical SPEC §2 names: ``"all"``, or names from ``METRIC_NAMES`` (``"contrast"``
    means ``contrast_token``). Unknown names are a :class:`QKGeomError`."""
    if isinstance(metrics, str):
        metrics = METRIC_NAMES if metrics == "all" else (metrics,)
    out: list[str] = []
    for name in metrics:
        name = _ALIASES.get(name, name)
        if name not in METRIC_NAMES:
            raise QKGeomError(f"unknown metric {name!r}; choose from {', '.join(METRIC_NAMES)}, "
                              "'contrast' or 'all'")
        if name not in out:
            out.append(name)
    if not out:
        raise QKGeomError("metrics is empty: name at least one metric to monitor")
    return tuple(out)


@dataclass
class Probe:
    """What one probe measured.

    ``frame``: long ``layer, head, metric, value`` rows of the requested metrics (head −1 =
    layer). ``key_sv_weight``: per layer, the singular values of W_K (descending);
    ``key_eig_token``: per layer, the eigenvalues of the key covariance on the probe set
    (descending) -- the two "key spectra"; empty unless asked for. ``seconds``: wall time.
    """

    step: int
    frame: pd.DataFrame
    seconds: float = 0.0
    key_sv_weight: dict[int, Tensor] = field(default_factory=dict)
    key_eig_token: dict[int, Tensor] = field(default_factory=dict)

    def layer_values(self, metric: str) -> dict[int, float]:
        """``{layer: value}`` of a metric at the layer level (head −1)."""
        rows = self.frame[(self.frame["metric"] == metric) & (self.frame["head"] == -1)]
        return {int(r.layer): float(r.value) for r in rows.itertuples()}


def _forward(net: nn.Module, adapter: ModelAdapter, ids: Tensor) -> None:
    if adapter.arch == "qkgeom":
        net(ids)
    elif adapter.causal:
        net(input_ids=ids, use_cache=False)
    else:
        net(input_ids=ids)


def measure(model: nn.Module, adapter: ModelAdapter, ids: Tensor, metrics: tuple[str, ...], *,
            batch_size: int = 8, qk_site: str = "post-rotary",
            spectra: bool = False) -> Probe:
    """Probe ``model`` on ``ids`` (n_seq, T): the ``metrics`` (canonical names) per layer and
    head, and the key spectra when ``spectra``. Training state is left untouched."""
    import time

    t0 = time.perf_counter()
    net = getattr(model, "base_model", model)  # HF: skip the task head; ours: itself
    want_token = any(m in TOKEN_METRICS for m in metrics) or spectra
    want_weight = any(m in WEIGHT_METRICS for m in metrics)
    acc: dict[int, LayerGeometry] = {}
    with frozen_training_state(model):
        device = next(model.parameters()).device
        if want_token:
            acc = {s.layer: LayerGeometry(s.n_head, s.n_kv_head, s.head_dim, adapter.causal,
                                          with_logit_spectrum="pr_qk_token" in metrics)
                   for s in adapter.sites}
            seen: set[int] = set()

            def on_qk(layer: int, q_site: Tensor, k_site: Tensor, q_attn: Tensor,
                      k_attn: Tensor, scale: float) -> None:
                seen.add(layer)
                acc[layer].update(q_site.float(), k_site.float(), q_attn.float(),
                                  k_attn.float(), scale)  # q (B, H, T, hd), k (B, H_kv, T, hd)

            with capture_qk(net, adapter, on_qk, qk_site), \
                    torch.autocast(device.type, enabled=False):
                for chunk in ids.split(batch_size):  # (b, T)
                    _forward(net, adapter, chunk.to(device))
            missing = sorted(set(acc) - seen)
            if missing:
                raise QKGeomError(f"no q/k captured for layers {missing}: the attention "
                                  "implementation bypasses the HF attention interface; load "
                                  "the model with attn_implementation='sdpa' or 'eager'")
        records: dict[int, list] = {s.layer: [] for s in adapter.sites}
        if want_weight:
            for layer, recs in model_weight_records(adapter).items():
                records[layer] += recs
        for layer, geo in acc.items():
            records[layer] += geo.records()
        probe = Probe(step=-1, frame=_select(records_to_frame(records), metrics))
        if spectra:
            for site in adapter.sites:
                w_k = site.qk_weights()[1].to(torch.float64)  # (H_kv·hd, d)
                probe.key_sv_weight[site.layer] = torch.linalg.svdvals(w_k).cpu()
                cov = acc[site.layer].cov_k.covariance()[0]  # (H_kv·hd, H_kv·hd)
                probe.key_eig_token[site.layer] = (
                    torch.linalg.eigvalsh(cov).flip(-1).clamp_min(0).cpu())
    probe.seconds = time.perf_counter() - t0
    return probe


def _select(frame: pd.DataFrame, metrics: tuple[str, ...]) -> pd.DataFrame:
    order = {m: i for i, m in enumerate(metrics)}
    out = frame[frame["metric"].isin(order)]
    return out.reset_index(drop=True)
