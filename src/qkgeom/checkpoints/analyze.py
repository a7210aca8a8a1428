"""Token-level Q/K geometry of one model over a text corpus: :func:`analyze_model`.

The text is tokenized in order (the model's own tokenizer), cut into windows of ``seq_len``
tokens and streamed through :func:`qkgeom.geometry.measure_batches` in batches, so memory is
one batch of activations plus O(L·(H·hd)²) float64 accumulators, whatever the token count.
Encoders (BERT) get ``[CLS] … [SEP]`` around every window; decoders see raw windows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from qkgeom.arch import ModelAdapter, adapter_for
from qkgeom.data.text import token_windows
from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES, measure_batches

__all__ = ["DEFAULT_SEQ_LEN", "analyze_model"]

DEFAULT_SEQ_LEN = 512  # cap on the window length (the model's context if shorter)
_TOKENS_PER_BATCH = 8192


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


def _batches(windows: Iterable[np.ndarray], before: list[int], after: list[int],
             batch_size: int, progress: Callable[[int], None] | None) -> Iterator[torch.Tensor]:
    """Token windows framed by the special ids, stacked ``batch_size`` at a time (a short
    last window runs alone); ``progress`` hears of each batch's text tokens once the
    consumer asks for the next one, i.e. once the batch is measured."""
    batch: list[np.ndarray] = []

    def emit() -> Iterator[torch.Tensor]:
        yield torch.from_numpy(np.stack([np.concatenate([before, w, after]).astype(np.int64)
                                         for w in batch]))  # (B, T)
        if progress is not None:
            progress(sum(len(w) for w in batch))

    for window in windows:
        if batch and len(window) != len(batch[0]):
            yield from emit()
            batch = []
        batch.append(window)
        if len(batch) == batch_size:
            yield from emit()
            batch = []
    if batch:
        yield from emit()


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
    precision: str = "float32",
    progress: Callable[[int], None] | None = None,
    **columns: Any,
) -> pd.DataFrame:
    """Every metric of ``model`` per layer and head on the first ``max_tokens`` text tokens.

    Args:
        model: an HF model of a supported architecture (task heads are looked through) or
            the project's GPT.
        tokenizer: its HF tokenizer (a :class:`~qkgeom.data.CharVocab` for our runs).
        texts: a string, an iterable of strings read in order, or a callable returning one.
        max_tokens: text tokens to analyse (special tokens of encoders come on top).
        seq_len: window length; default min(model context, 512) (encoders: minus 2 for
            [CLS]/[SEP]).
        batch_size: windows per forward; default about 8192 tokens per batch.
        qk_site: ``post-rotary`` (default) or ``pre-rotary`` queries/keys for the token PRs.
        logit_spectrum: compute ``pr_qk_token`` (left out when False).
        precision: ``float32`` (default: long corpora) or ``float64`` products.
        progress: called with the number of text tokens of each finished batch.
        **columns: constant columns put in front (e.g. ``checkpoint="step1000"``).

    Returns:
        Long frame ``[*columns], layer, head, metric, value`` (head −1 = layer; heads are
        query heads) with ``attrs``: ``arch``, ``tokens``, ``positions``, ``seconds``,
        ``tokens_per_s``, ``seq_len``, ``n_head``, ``n_kv_head``, ``causal``, ``rotary``,
        ``qk_site``.
    """
    adapter = adapter_for(model)
    before, after = _specials(tokenizer, adapter)
    extra = len(before) + len(after)
    limit = adapter.max_positions or DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, DEFAULT_SEQ_LEN) - extra
    if seq_len + extra > limit:
        raise QKGeomError(f"sequence length {seq_len} (+{extra} special tokens) exceeds the "
                          f"model's context of {limit} positions")
    batch_size = batch_size or max(1, _TOKENS_PER_BATCH // seq_len)
    windows = token_windows(tokenizer, _texts(texts), max_tokens, seq_len)
    metrics = "all" if logit_spectrum else [m for m in METRIC_NAMES if m != "pr_qk_token"]
    with torch.inference_mode():
        result = measure_batches(model, _batches(windows, before, after, batch_size, progress),
                                 metrics=metrics, qk_site=qk_site, precision=precision,
                                 **columns)
    positions = result.tokens
    tokens = positions - extra * result.sequences
    site = adapter.sites[0]
    frame = result.frame
    frame.attrs.update(arch=adapter.arch, tokens=tokens, positions=positions,
                       seconds=result.seconds, tokens_per_s=tokens / max(result.seconds, 1e-9),
                       seq_len=seq_len, n_head=site.n_head, n_kv_head=site.n_kv_head,
                       causal=adapter.causal, rotary=adapter.rotary, qk_site=qk_site)
    return frame
