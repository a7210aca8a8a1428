"""Raw text read in order, and its tokens (any tokenizer) in fixed-length windows.

Used where a model brings its own tokenizer: checkpoint analysis (``--text``) and the
monitor's text probe sets. A text spec names a corpus:

- ``sample`` (default): the embedded Wikipedia text, its held-out splits first
  (val, then test, then train), so the first tokens of a character-level run are exactly
  the trainer's probe set; read from the sample cache (:func:`~qkgeom.data.ensure_sample_data`
  keeps it beside the token arrays);
- ``wikitext-103[:split]``: WikiText-103 raw through ``datasets`` (split ``validation``
  by default; ``train``, ``validation``/``valid``/``val``, ``test``);
- any UTF-8 text file, or a folder of them (sorted by path).

The model's own tokenizer is applied to the raw text, a block of lines at a time, until
the token budget is met; a :class:`~qkgeom.data.CharVocab` is the tokenizer of the
project's own runs. Nothing is held but the current block, so memory does not grow with
the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qkgeom.data.prepare import SAMPLE_TEXT, ensure_sample_data
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
    if spec == "sample":
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
    """The ids an encoder's tokenizer puts around one sequence: ``[CLS]`` before and
    ``[SEP]`` after (each only if the tokenizer has it; none for a CharVocab).

    Why here and not in :func:`encode`: text is tokenized in blocks of many windows, so
    the tokenizer's own special tokens would land around blocks, not windows; callers frame
    each window themselves (``qkgeom analyze`` and the monitor's text probes, for
    encoders)."""
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
