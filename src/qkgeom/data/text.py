"""Raw text read in order, and its tokens (any tokenizer) in fixed-length windows.

For models that bring their own tokenizer (``qkgeom analyze --text``, the monitor's text
probe sets; a :class:`~qkgeom.data.CharVocab` for our runs). A text spec is ``sample`` (the
embedded text from the sample cache, held-out splits first, so a character-level run's
first tokens are its probe set), ``wikitext-103[:split]`` or a UTF-8 file or folder
(docs/data.md). Text is tokenized a block of lines at a time, so memory does not grow
with the token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qkgeom.data.prepare import SAMPLE, SAMPLE_TEXT, ensure_sample_data
from qkgeom.data.sources import read_utf8, text_files, wikitext103_pieces
from qkgeom.data.vocab import CharVocab
from qkgeom.errors import QKGeomError

__all__ = ["TEXT_HELP", "encode", "framing_ids", "open_text", "token_windows"]

TEXT_HELP = "sample | wikitext-103[:split] | a UTF-8 file or folder"
_BLOCK_CHARS = 1 << 16  # characters tokenized at a time (cut at a line end)
_WIKITEXT_SPLITS = {"train": "train", "validation": "val", "valid": "val", "val": "val",
                    "test": "test"}


def open_text(spec: str) -> Callable[[], Iterator[str]]:
    """A re-iterable source of the corpus ``spec`` (see the module docstring): calling it
    yields the text in order, in pieces. Validates ``spec`` now (QKGeomError if bad)."""
    if spec == SAMPLE:
        path = ensure_sample_data() / SAMPLE_TEXT
        return lambda: iter([read_utf8(path)])
    if spec == "wikitext-103" or spec.startswith("wikitext-103:"):
        name = spec.partition(":")[2] or "validation"
        if name not in _WIKITEXT_SPLITS:
            raise QKGeomError(f"unknown WikiText split {name!r}; choose one of "
                              + ", ".join(sorted(_WIKITEXT_SPLITS)))
        return lambda: wikitext103_pieces(_WIKITEXT_SPLITS[name])
    path = Path(spec)
    if not path.exists():
        raise QKGeomError(f"--text {spec!r}: no such file or folder; use {TEXT_HELP}")
    files = text_files(path)
    return lambda: (read_utf8(f) for f in files)


def encode(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of ``text`` (int64) without special tokens: an HF tokenizer, a
    :class:`CharVocab`, or anything with ``encode(text) -> ids``."""
    if isinstance(tokenizer, CharVocab):
        return tokenizer.encode(text).astype(np.int64)
    if callable(tokenizer) and hasattr(tokenizer, "convert_tokens_to_ids"):  # HF tokenizer
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    else:
        ids = tokenizer.encode(text)
    return np.asarray(ids, dtype=np.int64)


def framing_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids an encoder's tokenizer puts around one sequence (``[CLS]``, ``[SEP]``, where
    it has them): text is tokenized in blocks of many windows, so callers frame each
    window themselves instead of :func:`encode`."""
    cls = getattr(tokenizer, "cls_token_id", None)
    sep = getattr(tokenizer, "sep_token_id", None)
    return ([int(cls)] if cls is not None else []), ([int(sep)] if sep is not None else [])


def _blocks(pieces: Iterable[str]) -> Iterator[str]:
    """Pieces cut into blocks of about ``_BLOCK_CHARS`` at line ends (tokenizers never
    merge across a newline boundary in practice, so the ids match one big call)."""
    for piece in pieces:
        start = 0
        while start < len(piece):
            end = min(len(piece), start + _BLOCK_CHARS)
            if end < len(piece):
                nl = piece.find("\n", end)
                end = len(piece) if nl == -1 else nl + 1
            yield piece[start:end]
            start = end


def token_windows(tokenizer: Any, pieces: Iterable[str], max_tokens: int,
                  seq_len: int) -> Iterator[np.ndarray]:
    """Consecutive windows of ``seq_len`` text tokens (the last may be shorter) covering the
    first ``max_tokens`` tokens of the text, in order."""
    if max_tokens < 1 or seq_len < 1:
        raise QKGeomError(f"--tokens and the sequence length must be >= 1, got {max_tokens}, "
                          f"{seq_len}")
    buf = np.zeros(0, dtype=np.int64)
    left = max_tokens
    for block in _blocks(pieces):
        buf = np.concatenate([buf, encode(tokenizer, block)[:left + seq_len]])
        while len(buf) >= seq_len and left > 0:
            n = min(seq_len, left)
            yield buf[:n]
            buf, left = buf[n:], left - n
        if left == 0:
            return
    if left > 0 and len(buf):
        yield buf[:left]
