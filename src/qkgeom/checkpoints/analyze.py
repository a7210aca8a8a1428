"""Token-level Q/K geometry of one model over a text corpus: :func:`analyze_model`.

The text is tokenized in order by the model's own tokenizer, cut into windows and
streamed through :func:`qkgeom.geometry.measure_batches`, so memory is one batch plus the
float64 accumulators whatever the token count. Token blocks (the E4 bootstrap) are
contiguous runs of windows, the same for every checkpoint of one text and settings
(docs/checkpoints.md#token-blocks-for-the-bootstrap).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from qkgeom.arch import adapter_for
from qkgeom.data.text import framing_ids, token_windows
from qkgeom.errors import QKGeomError, require_whole
from qkgeom.geometry import METRIC_NAMES, Measurement, measure_batches

__all__ = ["DEFAULT_SEQ_LEN", "analyze_model"]

DEFAULT_SEQ_LEN = 512  # cap on the window length (the model's context if shorter)
_TOKENS_PER_BATCH = 8192


def _texts(texts: str | Iterable[str] | Callable[[], Iterable[str]]) -> Iterable[str]:
    if isinstance(texts, str):
        return [texts]
    return texts() if callable(texts) else texts


def _batches(windows: Iterable[tuple[int, np.ndarray]], before: list[int], after: list[int],
             batch_size: int, progress: Callable[[int], None] | None
             ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(block, ids)``: the windows framed by the special ids, ``batch_size`` at a time,
    never mixing blocks or lengths; ``progress`` hears of a batch's text tokens once the
    next one is asked for, i.e. once it is measured."""
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
    """The blocks a text of ``windows`` windows gets when ``blocks`` are asked for: a block
    needs a window, and below two windows there is one (every token together)."""
    return blocks if windows >= blocks else (windows if windows >= 2 else 1)


def _block_plan(held: list[np.ndarray], blocks: int
                ) -> tuple[list[tuple[int, np.ndarray]], list[int]]:
    """Every window with its block (window i of n in block ⌊i·blocks/n⌋) and the text
    tokens of each block."""
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
    """Every metric of ``model`` per layer and head on the first ``max_tokens`` text
    tokens of ``texts`` (a string, strings, or a callable returning them), as a long frame
    ``[*columns], layer, head, metric, value, block`` (head −1: the layer; block −1: all
    tokens) with ``attrs`` (:func:`analysis_frame`).

    ``model`` is an HF model of a supported family or the project's GPT (``tokenizer`` a
    :class:`~qkgeom.data.CharVocab`). ``seq_len`` defaults to min(context, 512) less an
    encoder's [CLS]/[SEP], ``batch_size`` to about 8192 tokens. ``qk_site="pre-rotary"``
    also records a rotary model's post-rotary PRs (``pr_*_token_post``; attention
    statistics always use the post-rotary q/k). ``blocks`` K > 1 records every metric per
    token block too; ``progress`` hears of each batch's text tokens; ``columns`` are
    constant columns put in front (docs/checkpoints.md).
    """
    adapter = adapter_for(model)
    before, after = ([], []) if adapter.causal else framing_ids(tokenizer)  # [CLS], [SEP]
    extra = len(before) + len(after)
    limit = adapter.max_positions or DEFAULT_SEQ_LEN
    seq_len = seq_len or min(limit, DEFAULT_SEQ_LEN) - extra
    if seq_len + extra > limit:
        raise QKGeomError(f"sequence length {seq_len} (+{extra} special tokens) exceeds the "
                          f"model's context of {limit} positions")
    require_whole("--blocks", blocks)
    batch_size = batch_size or max(1, _TOKENS_PER_BATCH // seq_len)
    windows = token_windows(tokenizer, _texts(texts), max_tokens, seq_len)
    numbered: Iterable[tuple[int, np.ndarray]] = ((-1, w) for w in windows)
    sizes: list[int] = []
    if blocks > 1:  # a text shorter than the blocks asked for gets fewer (fitting_blocks)
        held = list(windows)
        blocks = fitting_blocks(len(held), blocks)
        numbered, sizes = (_block_plan(held, blocks) if blocks > 1
                           else (((-1, w) for w in held), []))
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
    tokens) when unblocked, and ``attrs``: arch, tokens, positions, seconds, tokens_per_s,
    seq_len, n_head, n_kv_head, causal, rotary, qk_site, blocks, block_tokens."""
    adapter, site, frame = result.adapter, result.adapter.sites[0], result.frame
    if "block" not in frame:
        frame["block"] = pd.Series([-1] * len(frame), dtype="int64")
    frame.attrs.update(arch=adapter.arch, tokens=tokens, positions=result.tokens,
                       seconds=result.seconds, tokens_per_s=tokens / max(result.seconds, 1e-9),
                       seq_len=seq_len, n_head=site.n_head, n_kv_head=site.n_kv_head,
                       causal=adapter.causal, rotary=adapter.rotary, qk_site=qk_site,
                       blocks=blocks, block_tokens=block_tokens)
    return frame
