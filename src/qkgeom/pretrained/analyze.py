"""Streaming token-level geometry of one model: ``analyze_model``.

The text is tokenized in order, cut into windows of ``seq_len`` tokens, and run through
the model in batches under ``torch.inference_mode()``; the q/k of every layer are captured
(:func:`~qkgeom.pretrained.adapters.capture_qk`) and streamed into a
:class:`~qkgeom.pretrained.accumulate.LayerGeometry` each, then dropped. Memory is one
batch of activations plus O(L·(H·hd)²) float64 accumulators, whatever the token count.
Encoders (BERT) get ``[CLS] … [SEP]`` around every window; decoders see raw windows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from qkgeom.errors import QKGeomError
from qkgeom.geometry import records_to_frame, weight_records
from qkgeom.pretrained.accumulate import LayerGeometry
from qkgeom.pretrained.adapters import ModelAdapter, capture_qk, find_attention_sites
from qkgeom.pretrained.text import token_windows
from qkgeom.pretrained.workspace import Workspace

__all__ = ["DEFAULT_SEQ_LEN", "analyze_model", "model_weight_records"]

DEFAULT_SEQ_LEN = 512  # cap on the window length (the model's context if shorter)
_TOKENS_PER_BATCH = 8192


def model_weight_records(adapter: ModelAdapter) -> dict[int, list]:
    """Weight-level records of every layer; under GQA each query head is paired with its
    key head by repeating W_K's heads (which leaves every PR unchanged, see adapters)."""
    out = {}
    for site in adapter.sites:
        w_q, w_k = site.qk_weights()
        R = site.group
        if R > 1:  # (H_kv·hd, d) -> (H·hd, d): key head g serves query heads g·R .. g·R+R-1
            w_k = w_k.view(site.n_kv_head, site.head_dim, -1).repeat_interleave(R, dim=0)
            w_k = w_k.reshape(site.n_head * site.head_dim, -1)
        out[site.layer] = weight_records(w_q.float(), w_k.float(), site.n_head)
    return out


def _specials(tokenizer: Any, adapter: ModelAdapter) -> tuple[list[int], list[int]]:
    """Ids put before / after each window: [CLS] / [SEP] for encoders, nothing otherwise."""
    if adapter.causal:
        return [], []
    cls = getattr(tokenizer, "cls_token_id", None)
    sep = getattr(tokenizer, "sep_token_id", None)
    return ([cls] if cls is not None else []), ([sep] if sep is not None else [])


def _texts(texts: str | Iterable[str] | Callable[[], Iterable[str]]) -> Iterable[str]:
    if isinstance(texts, str):
        return [texts]
    return texts() if callable(texts) else texts


@torch.inference_mode()
def analyze_model(
    model: nn.Module,
    tokenizer: Any,
    texts: str | Iterable[str] | Callable[[], Iterable[str]],
    *,
    max_tokens: int = 200_000,
    seq_len: int | None = None,
    batch_size: int | None = None,
    qk_site: str = "post-rotary",
    logit_spectrum: bool = True,
    progress: Callable[[int], None] | None = None,
    **columns: Any,
) -> pd.DataFrame:
    """SPEC §2 metrics of ``model`` per layer and head on the first ``max_tokens`` text tokens.

    Args:
        model: an HF model of a supported architecture (GPT-2, GPT-NeoX/Pythia,
            Llama-style, BERT-style; task heads are skipped) or the project's GPT.
        tokenizer: its HF tokenizer (a :class:`~qkgeom.data.CharVocab` for our runs).
        texts: a string, an iterable of strings read in order, or a callable returning one.
        max_tokens: text tokens to analyse (special tokens of encoders come on top).
        seq_len: window length; default min(model context, 512) (encoders: minus 2 for
            [CLS]/[SEP]).
        batch_size: windows per forward; default about 8192 tokens per batch.
        qk_site: ``post-rotary`` (default) or ``pre-rotary`` queries/keys for the token PRs
            (attention statistics always use what the attention computes with).
        logit_spectrum: compute ``pr_qk_token`` (per-sequence logit SVD); NaN when False.
        progress: called with the number of text tokens of each finished batch.
        **columns: constant columns put in front (e.g. ``checkpoint="step1000"``).

    Returns:
        Long frame ``[*columns], layer, head, metric, value`` (head −1 = layer; heads are
        query heads) with ``attrs``: ``arch``, ``tokens``, ``positions``, ``seconds``,
        ``tokens_per_s``, ``seq_len``, ``n_head``, ``n_kv_head``.
    """
    adapter = find_attention_sites(model)
    net = getattr(model, "base_model", model)
    device = next(net.parameters()).device
    was_training = net.training
    net.eval()
    before, after = _specials(tokenizer, adapter)
    limit = adapter.max_positions or DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, DEFAULT_SEQ_LEN) - len(before) - len(after)
    if seq_len + len(before) + len(after) > limit:
        raise QKGeomError(f"sequence length {seq_len} (+{len(before) + len(after)} special "
                          f"tokens) exceeds the model's context of {limit} positions")
    batch_size = batch_size or max(1, _TOKENS_PER_BATCH // seq_len)
    workspace = Workspace()  # scratch buffers reused by every layer and batch
    acc = {s.layer: LayerGeometry(s.n_head, s.n_kv_head, s.head_dim, adapter.causal,
                                  logit_spectrum, workspace) for s in adapter.sites}
    seen: set[int] = set()

    def on_qk(layer, q_site, k_site, q_attn, k_attn, scale) -> None:
        acc[layer].update(q_site, k_site, q_attn, k_attn, scale)
        seen.add(layer)

    def run(batch: list[np.ndarray]) -> None:
        ids = torch.from_numpy(np.stack([np.concatenate([before, w, after]).astype(np.int64)
                                         for w in batch])).to(device)  # (B, T)
        seen.clear()
        if adapter.arch == "qkgeom":
            net(ids)
        else:
            net(input_ids=ids, use_cache=False) if adapter.causal else net(input_ids=ids)
        missing = sorted(set(acc) - seen)
        if missing:
                raise QKGeomError(f"no q/k captured for layers {missing}: the attention "
                              "implementation bypasses the HF attention interface; load the "
                              "model with attn_implementation='sdpa' or 'eager'")
        if progress is not None:
            progress(sum(len(w) for w in batch))

    n_tokens = n_positions = 0
    t0 = time.perf_counter()
    try:
        with capture_qk(net, adapter, on_qk, qk_site):
            batch: list[np.ndarray] = []
            for window in token_windows(tokenizer, _texts(texts), max_tokens, seq_len):
                if batch and len(window) != len(batch[0]):  # a short last window runs alone
                    run(batch)
                    batch = []
                batch.append(window)
                n_tokens += len(window)
                n_positions += len(window) + len(before) + len(after)
                if len(batch) == batch_size:
                    run(batch)
                    batch = []
            if batch:
                run(batch)
    finally:
        net.train(was_training)
    seconds = time.perf_counter() - t0
    if n_tokens == 0:
        raise QKGeomError("the text gave no tokens to analyse")
    weights = model_weight_records(adapter)
    frame = records_to_frame({i: weights[i] + acc[i].records() for i in acc}, **columns)
    site = adapter.sites[0]
    frame.attrs.update(arch=adapter.arch, tokens=n_tokens, positions=n_positions,
                       seconds=seconds, tokens_per_s=n_tokens / max(seconds, 1e-9),
                       seq_len=seq_len, n_head=site.n_head, n_kv_head=site.n_kv_head,
                       causal=adapter.causal, rotary=adapter.rotary, qk_site=qk_site)
    return frame
