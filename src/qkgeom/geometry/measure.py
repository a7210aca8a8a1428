"""``measure(model, input_ids)``: every Q/K geometry metric of a model, per layer and head.

The one measurement path: the trainer's probes, the monitor and checkpoint analysis all
call :func:`measure` / :func:`measure_batches`, so a number means the same thing whichever
produced it. Read top to bottom: :func:`~qkgeom.arch.adapter_for` says where q/k live;
:class:`_TokenPasses` runs the forward passes (the adapter's ``net``: our GPT whole, LM
head included; an HF model's base model) in eval mode without gradients or autocast,
inside :func:`~qkgeom.geometry.state.frozen_training_state`, and streams each layer's q/k
into a :class:`~qkgeom.geometry.tokens.LayerGeometry`; :func:`_frame_of` adds the weight
metrics and builds the long frame. Padding, precision, token blocks and ``previous``:
docs/definitions.md#how-the-metrics-are-computed, #probe-set, #token-blocks, #logit-growth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import pandas as pd
import torch
from torch import Tensor, nn

from qkgeom.arch import ModelAdapter, adapter_for
from qkgeom.errors import QKGeomError
from qkgeom.geometry.padding import Padded, check_mask, right_padded
from qkgeom.geometry.records import (
    METRIC_NAMES,
    TOKEN_METRICS,
    WEIGHT_METRICS,
    Record,
    records_to_frame,
    weight_records,
)
from qkgeom.geometry.state import frozen_training_state
from qkgeom.geometry.tokens import LayerGeometry
from qkgeom.geometry.workspace import Workspace

__all__ = ["PRECISIONS", "Measurement", "measure", "measure_batches", "resolve_metrics"]

PRECISIONS = {"float64": torch.float64, "float32": torch.float32}
_ALIASES = {"contrast": "contrast_token"}


def resolve_metrics(metrics: str | Iterable[str]) -> tuple[str, ...]:
    """Canonical metric names: ``"all"``, or names from ``METRIC_NAMES`` (``"contrast"``
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
        raise QKGeomError("metrics is empty: name at least one metric")
    return tuple(out)


@dataclass
class Measurement:
    """What one measurement found.

    ``frame``: long ``layer, head, metric, value`` rows (head −1 = layer), constant columns
    in front. ``key_sv_weight`` / ``key_eig_token``: per layer, the singular values of W_K
    and the eigenvalues of the key covariance, descending (with ``spectra=True``). ``step``:
    set by the caller. ``tokens``: real query positions measured. ``block_tokens``: per
    token block. ``logit_windows``: per layer, the scaled q/k of the first window, which the
    next measurement's ``logit_delta`` compares with."""

    frame: pd.DataFrame
    adapter: ModelAdapter
    step: int | None = None  # the training step, when the caller knows it
    tokens: int = 0
    sequences: int = 0
    seconds: float = 0.0
    key_sv_weight: dict[int, Tensor] = field(default_factory=dict)
    key_eig_token: dict[int, Tensor] = field(default_factory=dict)
    block_tokens: dict[int, int] = field(default_factory=dict)
    logit_windows: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def layer_values(self, metric: str) -> dict[int, float]:
        """``{layer: value}`` of a metric at the layer level (head −1)."""
        rows = self.frame[(self.frame["metric"] == metric) & (self.frame["head"] == -1)]
        if "block" in rows:
            rows = rows[rows["block"] == -1]
        return {int(r.layer): float(r.value) for r in rows.itertuples()}

    def __repr__(self) -> str:
        return (f"Measurement({self.adapter.arch}, {self.adapter.n_layer} layers, "
                f"{self.sequences} sequences × {self.tokens // max(self.sequences, 1)} tokens, "
                f"{self.frame['metric'].nunique()} metrics, {self.seconds:.2f} s)")


#: What ``previous=`` takes: the previous Measurement, its logit windows, or nothing.
Previous = Union["Measurement", Mapping[int, tuple[Tensor, Tensor]], None]


def measure(model: nn.Module, input_ids: Tensor, *, attention_mask: Tensor | None = None,
            metrics: str | Iterable[str] = "all", batch_size: int = 8,
            qk_site: str = "post-rotary", precision: str = "float64", spectra: bool = False,
            previous: Previous = None, **columns: Any) -> Measurement:
    """Measure ``model`` on the token windows ``input_ids`` (n_seq, T), ``batch_size`` at a
    time; ``attention_mask`` (n_seq, T), 0 on padding, measures real tokens only. The rest:
    :func:`measure_batches`."""
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise QKGeomError(f"input_ids must be a non-empty integer (n_seq, T) tensor, got "
                          f"{ids.dtype} {tuple(ids.shape)}")
    if batch_size < 1:
        raise QKGeomError(f"batch_size must be >= 1, got {batch_size}")
    mask = check_mask(ids, attention_mask)
    batches = ids.split(batch_size) if mask is None else [
        {"input_ids": i, "attention_mask": m}
        for i, m in zip(ids.split(batch_size), mask.split(batch_size), strict=True)]
    return measure_batches(model, batches, metrics=metrics, qk_site=qk_site,
                           precision=precision, spectra=spectra, previous=previous, **columns)


def measure_batches(model: nn.Module, batches: Iterable[Any], *,
                    metrics: str | Iterable[str] = "all", qk_site: str = "post-rotary",
                    precision: str = "float64", spectra: bool = False,
                    progress: Callable[[int], None] | None = None,
                    blocked: bool = False, previous: Previous = None,
                    **columns: Any) -> Measurement:
    """Every requested metric of ``model`` (our GPT or a supported HF model) over token-id
    batches read in turn.

    ``batches``: (B, T) ids (T may vary), or mappings with ``input_ids`` and an
    ``attention_mask``; with ``blocked``, ``(block, batch)`` pairs in block order, and the
    frame gets a ``block`` column (−1 = all tokens). ``metrics``: names of ``METRIC_NAMES``,
    ``"contrast"`` or ``"all"``. ``qk_site``: ``post-rotary`` (what attention uses) or
    ``pre-rotary`` q/k for the token PRs (then also the ``_post`` PRs on a rotary model).
    ``precision``: ``float64`` or ``float32`` products. ``spectra``: also the key spectra.
    ``progress``: called with each batch's real tokens. ``previous``: the previous
    :class:`Measurement` of the same probe set, or its ``logit_windows``. ``columns``:
    constant columns in front (``run_id=..., step=...``).

    Raises QKGeomError (bad arguments, an unsupported architecture, an attention that
    bypasses the capture) or NonFiniteError (a diverged model has no geometry)."""
    t0 = time.perf_counter()
    wanted = resolve_metrics(metrics)
    if precision not in PRECISIONS:
        raise QKGeomError(f"unknown precision {precision!r}; choose one of "
                          f"{', '.join(PRECISIONS)}")
    adapter = adapter_for(model)
    windows = previous.logit_windows if isinstance(previous, Measurement) else previous
    passes = _TokenPasses(adapter, PRECISIONS[precision], qk_site, windows or {})
    with frozen_training_state(model):
        if spectra or any(m in TOKEN_METRICS for m in wanted):  # weight metrics need none
            passes.run(batches, wanted, blocked, progress, next(model.parameters()).device)
        out = Measurement(_frame_of(adapter, passes, wanted, columns, blocked), adapter,
                          tokens=passes.tokens, sequences=passes.sequences,
                          block_tokens=passes.block_tokens,
                          logit_windows={layer: geo.window for layer, geo in passes.layers.items()
                                         if geo.window is not None})
        if spectra:  # the two key spectra, descending
            for site in adapter.sites:
                w_k = site.weight("k").to(torch.float64)  # (H_kv·hd, d)
                out.key_sv_weight[site.layer] = torch.linalg.svdvals(w_k).cpu()
                cov = passes.layers[site.layer].key_covariance()  # (H_kv·hd, H_kv·hd)
                out.key_eig_token[site.layer] = \
                    torch.linalg.eigvalsh(cov).flip(-1).clamp_min(0).cpu()
    out.seconds = time.perf_counter() - t0
    return out


class _TokenPasses:
    """The forward passes of a measurement: the adapter's capture hands each layer's q/k to
    :meth:`on_qk`, which streams them into that layer's ``LayerGeometry`` (and open block)."""

    def __init__(self, adapter: ModelAdapter, dtype: torch.dtype, qk_site: str,
                 previous: Mapping[int, tuple[Tensor, Tensor]]) -> None:
        self.adapter, self.dtype, self.qk_site = adapter, dtype, qk_site
        self.previous = previous  # logit windows of the previous measurement, by layer
        self.layers: dict[int, LayerGeometry] = {}  # by :meth:`run`
        self.lengths: Tensor | None = None  # real tokens per row of the batch in hand
        self.seen: set[int] = set()  # layers whose q/k the batch in hand delivered
        self.tokens = self.sequences = 0
        self.block_tokens: dict[int, int] = {}
        self.block_records: dict[int, dict[int, list[Record]]] = {}

    def on_qk(self, layer: int, q_site: Tensor, k_site: Tensor, q_attn: Tensor,
              k_attn: Tensor, scale: float) -> None:
        """The capture's callback (:data:`~qkgeom.arch.QKCallback`)."""
        self.seen.add(layer)
        d = self.dtype
        self.layers[layer].update(q_site.to(d), k_site.to(d), q_attn.to(d), k_attn.to(d),
                                  scale, lengths=self.lengths)

    def run(self, batches: Iterable[Any], wanted: tuple[str, ...], blocked: bool,
            progress: Callable[[int], None] | None, device: torch.device) -> None:
        """Every batch through the model, token blocks opened and closed in order."""
        ws = Workspace()  # scratch buffers shared by every layer and batch
        post = self.adapter.rotary and self.qk_site == "pre-rotary"  # site q/k != attention's
        self.layers = {s.layer: LayerGeometry(s.n_head, s.n_kv_head, s.head_dim,
                                              self.adapter.causal, "pr_qk_token" in wanted,
                                              ws, post, self.previous.get(s.layer),
                                              self.adapter.logit_softcap)
                       for s in self.adapter.sites}
        current = -1
        with self.adapter.capture(self.on_qk, self.qk_site), \
                torch.autocast(device.type, enabled=False):
            for block, batch in _blocks_in_order(batches, blocked):
                if block != current:
                    self._end_block(current)
                    for geo in self.layers.values():
                        geo.begin_block()
                    current = block
                real = self._forward(batch, device)
                if blocked:
                    self.block_tokens[block] = self.block_tokens.get(block, 0) + real
                if progress is not None:
                    progress(real)
        self._end_block(current)
        if self.sequences == 0:
            raise QKGeomError("no token windows to measure")

    def _forward(self, batch: Any, device: torch.device) -> int:
        """One forward pass over ``batch``; returns its real tokens."""
        self.seen.clear()
        ids, padded = _unpadded(batch)
        self.lengths = None if padded is None else padded.lengths
        # right padding: a causal model needs no mask (real tokens come first)
        mask = None if padded is None or self.adapter.causal else padded.mask
        self.adapter.forward(ids.to(device), mask)
        missing = sorted(set(self.layers) - self.seen)
        if missing:
            raise QKGeomError(f"no q/k captured for layers {missing}: the attention "
                              "implementation bypasses the HF attention interface; "
                              "load the model with attn_implementation='sdpa'")
        real = ids.numel() if padded is None else padded.tokens
        self.tokens += real
        self.sequences += ids.shape[0]
        return real

    def _end_block(self, block: int) -> None:
        if block >= 0:
            self.block_records[block] = {layer: geo.end_block()
                                         for layer, geo in self.layers.items()}


def _blocks_in_order(batches: Iterable[Any], blocked: bool) -> Iterator[tuple[int, Any]]:
    """``(block, ids)`` of each batch (block −1 when not blocked); block indices must be
    whole numbers that never decrease (a block is contiguous)."""
    last = -1
    for item in batches:
        if not blocked:
            yield -1, item
            continue
        if not (isinstance(item, tuple) and len(item) == 2):
            raise QKGeomError("blocked=True: each batch must be a (block, token ids) pair")
        block, ids = int(item[0]), item[1]
        if block < max(last, 0):
            raise QKGeomError(f"token block {block} after block {last}: blocks must be "
                              "contiguous, numbered 0, 1, ... in order")
        last = block
        yield block, ids


def _unpadded(batch: Any) -> tuple[Tensor, Padded | None]:
    """Token ids of a batch (a tensor, or a mapping with ``input_ids`` and optionally an
    ``attention_mask``) and, when the mask pads anything, the batch moved to right padding."""
    if not isinstance(batch, Mapping):
        return torch.as_tensor(batch), None
    if "input_ids" not in batch:
        raise QKGeomError("a batch mapping needs 'input_ids'")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.ndim == 1:
        ids = ids[None]
    mask = check_mask(ids, batch.get("attention_mask"))
    if mask is None:
        return ids, None
    padded = right_padded(ids, mask)
    return padded.ids, padded


def _frame_of(adapter: ModelAdapter, passes: _TokenPasses, wanted: tuple[str, ...],
              columns: dict[str, Any], blocked: bool) -> pd.DataFrame:
    """The long frame of the ``wanted`` metrics, constant ``columns`` in front: weight and
    token records of every layer over all tokens and, when ``blocked``, over each token
    block (the ``block`` column, last)."""
    weights: dict[int, list[Record]] = {s.layer: [] for s in adapter.sites}
    if any(m in WEIGHT_METRICS for m in wanted):
        weights.update(_weight_records(adapter))
    tokens = {layer: geo.records() for layer, geo in passes.layers.items()}
    frames = []
    for block, part in {-1 if blocked else None: tokens, **passes.block_records}.items():
        frame = records_to_frame({layer: recs + part.get(layer, [])
                                  for layer, recs in weights.items()})
        if block is not None:
            frame["block"] = pd.Series([block] * len(frame), dtype="int64")
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True)
    frame = frame[frame["metric"].isin(wanted)].reset_index(drop=True)
    for i, (name, value) in enumerate(columns.items()):
        frame.insert(i, name, [value] * len(frame))
    return frame


def _weight_records(adapter: ModelAdapter) -> dict[int, list[Record]]:
    """Weight-level records of every layer; under GQA each query head is paired with its
    key head by repeating W_K's heads (which leaves every PR unchanged)."""
    out = {}
    for site in adapter.sites:
        w_q, w_k = site.qk_weights()  # (H·hd, d), (H_kv·hd, d)
        if site.group > 1:  # key head g serves query heads g·R .. g·R+R-1
            w_k = site.k_heads(w_k).repeat_interleave(site.group, dim=0).reshape(w_q.shape)
        out[site.layer] = weight_records(w_q.float(), w_k.float(), site.n_head)
    return out
