"""Token-level Q/K geometry of one model over a text corpus: :func:`analyze_model`.

The text is tokenized in order (the model's own tokenizer), cut into windows of ``seq_len``
tokens and streamed through :func:`qkgeom.geometry.measure_batches` in batches, so memory is
one batch of activations plus O(L·(H·hd)²) float64 accumulators, whatever the token count.
Encoders (BERT) get ``[CLS] … [SEP]`` around every window; decoders see raw windows.

Token blocks (``blocks=K``, for the bootstrap of docs/checkpoints.md): the windows are cut
into K contiguous runs of (nearly) equal size, window i in block ⌊i·K/n⌋, so the same
text and settings give the same blocks for every checkpoint; the metrics are recorded for
all tokens (``block = -1``) and per block from one pass (the window ids are held in memory
to count them: 8 bytes per token). A text of fewer windows than blocks asked for gets one
block per window (:func:`fitting_blocks`): a short analysis is measured, not refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from qkgeom.arch import ModelAdapter, adapter_for
from qkgeom.data.text import framing_ids, token_windows
from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES, Measurement, measure_batches

__all__ = ["DEFAULT_SEQ_LEN", "analyze_model"]

DEFAULT_SEQ_LEN = 512  # cap on the window length (the model's context if shorter)
_TOKENS_PER_BATCH = 8192


def _specials(tokenizer: Any, adapter: ModelAdapter) -> tuple[list[int], list[int]]:
    """Ids put before / after each window: [CLS] / [SEP] for encoders, nothing otherwise."""
    return ([], []) if adapter.causal else framing_ids(tokenizer)


def _texts(texts: str | Iterable[str] | Callable[[], Iterable[str]]) -> Iterable[str]:
    if isinstance(texts, str):
        return [texts]
    return texts() if callable(texts) else texts


def _batches(windows: Iterable[tuple[int, np.ndarray]], before: list[int], after: list[int],
             batch_size: int, progress: Callable[[int], None] | None
             ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(block, ids)``: token windows (with their block index) framed by the special ids,
    stacked ``batch_size`` at a time; a batch never mixes blocks or lengths (a short last
    window runs alone). ``progress`` hears of each batch's text tokens once the consumer
    asks for the next one, i.e. once the batch is measured."""
    batch: list[np.ndarray] = []
    block = -1

    def emit() -> Iterator[tuple[int, torch.Tensor]]:
        yield block, torch.from_numpy(np.stack([np.concatenate([before, w, after]).astype(
            np.int64) for w in batch]))  # (B, T)
        if progress is not None:
            progress(sum(len(w) for w in batch))

    for k, window in windows:
        if batch and (len(window) != len(batch[0]) or k != block):
            yield from emit()
            batch = []
        block = k
        batch.append(window)
        if len(batch) == batch_size:
            yield from emit()
            batch = []
    if batch:
        yield from emit()


def fitting_blocks(windows: int, blocks: int) -> int:
    """The token blocks a text of ``windows`` windows is cut into when ``blocks`` are asked
    for: a block needs a window, so a short text gets as many blocks as it has windows,
    and one block (none: every token together) when it has fewer than two."""
    return blocks if windows >= blocks else (windows if windows >= 2 else 1)


def _block_plan(held: list[np.ndarray], blocks: int
                ) -> tuple[list[tuple[int, np.ndarray]], list[int]]:
    """Every window with its block (window i of n in block ⌊i·blocks/n⌋: contiguous runs
    whose sizes differ by at most one window) and the text tokens of each block."""
    n = len(held)
    plan = [(i * blocks // n, w) for i, w in enumerate(held)]
    sizes = [0] * blocks
    for k, w in plan:
        sizes[k] += len(w)
    return plan, sizes


def analyze_model(
    model: nn.Module, tokenizer: Any, texts: str | Iterable[str] | Callable[[], Iterable[str]],
    *, max_tokens: int = 200_000, seq_len: int | None = None, batch_size: int | None = None,
    qk_site: str = "pre-rotary", logit_spectrum: bool = True, precision: str = "float32",
    blocks: int = 1, progress: Callable[[int], None] | None = None, **columns: Any,
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
        qk_site: ``pre-rotary`` (default) or ``post-rotary`` queries/keys for the token PRs
            (the same on models without rotary). On a rotary model the pre-rotary site also
            records the post-rotary PRs (``pr_*_token_post``); attention statistics,
            ``logit_std`` and ``pr_qk_token`` always use the post-rotary q/k.
        logit_spectrum: compute ``pr_qk_token`` (left out when False).
        precision: ``float32`` (default: long corpora) or ``float64`` products.
        blocks: K > 1 also records every metric per token block (module docstring); a
            text of fewer than K windows gets one block per window (``attrs["blocks"]``
            says how many; none below two windows).
        progress: called with the number of text tokens of each finished batch.
        **columns: constant columns put in front (e.g. ``checkpoint="step1000"``).

    Returns:
        Long frame ``[*columns], layer, head, metric, value, block`` (head −1 = layer;
        heads are query heads; block −1 = all tokens, k = token block k) with ``attrs``:
        ``arch``, ``tokens``, ``positions``, ``seconds``, ``tokens_per_s``, ``seq_len``,
        ``n_head``, ``n_kv_head``, ``causal``, ``rotary``, ``qk_site``, ``blocks``,
        ``block_tokens`` (text tokens per block).
    """
    adapter = adapter_for(model)
    before, after = _specials(tokenizer, adapter)
    extra = len(before) + len(after)
    limit = adapter.max_positions or DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, DEFAULT_SEQ_LEN) - extra
    if seq_len + extra > limit:
        raise QKGeomError(f"sequence length {seq_len} (+{extra} special tokens) exceeds the "
                          f"model's context of {limit} positions")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise QKGeomError(f"--blocks must be a whole number >= 1, got {blocks!r}")
    batch_size = batch_size or max(1, _TOKENS_PER_BATCH // seq_len)
    windows = token_windows(tokenizer, _texts(texts), max_tokens, seq_len)
    sizes: list[int] = []
    if blocks > 1:  # a text shorter than the blocks asked for gets fewer (fitting_blocks)
        held = list(windows)
        blocks = fitting_blocks(len(held), blocks)
        windows = iter(held)
    if blocks > 1:
        numbered, sizes = _block_plan(held, blocks)
    else:
        numbered = ((-1, w) for w in windows)
    stream = _batches(numbered, before, after, batch_size, progress)
    metrics = "all" if logit_spectrum else [m for m in METRIC_NAMES if m != "pr_qk_token"]
    with torch.inference_mode():
        result = measure_batches(model, stream if blocks > 1 else (ids for _, ids in stream),
                                 metrics=metrics, qk_site=qk_site, precision=precision,
                                 blocked=blocks > 1, **columns)
    return analysis_frame(result, tokens=result.tokens - extra * result.sequences,
                          seq_len=seq_len, qk_site=qk_site, blocks=blocks, block_tokens=sizes)


def analysis_frame(result: Measurement, *, tokens: int, seq_len: int, qk_site: str,
                   blocks: int, block_tokens: list[int]) -> pd.DataFrame:
    """``result.frame`` as :func:`analyze_model` returns it: a ``block`` column (−1, all
    tokens) when unblocked, and the ``attrs`` its Returns section lists."""
    adapter, site, frame = result.adapter, result.adapter.sites[0], result.frame
    if "block" not in frame:
        frame["block"] = pd.Series([-1] * len(frame), dtype="int64")
    frame.attrs.update(arch=adapter.arch, tokens=tokens, positions=result.tokens,
                       seconds=result.seconds, tokens_per_s=tokens / max(result.seconds, 1e-9),
                       seq_len=seq_len, n_head=site.n_head, n_kv_head=site.n_kv_head,
                       causal=adapter.causal, rotary=adapter.rotary, qk_site=qk_site,
                       blocks=blocks, block_tokens=block_tokens)
    return frame
