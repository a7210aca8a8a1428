"""Character vocabulary: the characters of the training split plus one unknown id.

The vocabulary is the train split's, so evaluation text may hold characters never seen:
they map to an explicit unknown id (``len(chars)``) instead of failing or aliasing another
character. Encoding goes through a code-point lookup table in chunks, so a corpus of any
size encodes with bounded extra memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkgeom.errors import QKGeomError

__all__ = ["CharVocab", "ENCODE_CHUNK_CHARS", "MAX_CODE_POINT", "UNKNOWN_CHAR"]

#: Characters encoded per numpy pass (~4 bytes each in the UTF-32 buffer).
ENCODE_CHUNK_CHARS = 1 << 24
#: Unicode code points run from 0 to 0x10FFFF.
MAX_CODE_POINT = 0x10FFFF
#: What :meth:`CharVocab.decode` prints for the unknown id (U+FFFD REPLACEMENT CHARACTER).
UNKNOWN_CHAR = "\ufffd"


def _code_points(text: str) -> np.ndarray:
    """Code points of ``text`` as uint32 (surrogatepass keeps lone surrogates encodable)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _chunks(text: str) -> Iterable[str]:
    size = ENCODE_CHUNK_CHARS  # read at call time so tests can shrink it
    for start in range(0, len(text), size):
        yield text[start : start + size]


@dataclass(frozen=True)
class CharVocab:
    """Sorted characters of the training split; id ``len(chars)`` is the unknown id."""

    chars: str
    _lut: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.chars)) != len(self.chars) or list(self.chars) != sorted(self.chars):
            raise QKGeomError("vocabulary characters must be unique and sorted by code point")
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        lut = np.full(MAX_CODE_POINT + 1, self.unknown_id, dtype=dtype)
        if self.chars:
            lut[_code_points(self.chars)] = np.arange(len(self.chars), dtype=dtype)
        object.__setattr__(self, "_lut", lut)

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> CharVocab:
        """Vocabulary of every character occurring in ``text`` (a str or an iterable of chunks)."""
        chunks = _chunks(text) if isinstance(text, str) else text
        seen = np.zeros(MAX_CODE_POINT + 1, dtype=bool)
        for chunk in chunks:
            for piece in _chunks(chunk):
                cps = _code_points(piece)
                seen |= np.bincount(cps, minlength=MAX_CODE_POINT + 1).astype(bool)
        cps = np.flatnonzero(seen).astype("<u4")
        return cls(cps.tobytes().decode("utf-32-le", "surrogatepass"))

    @property
    def unknown_id(self) -> int:
        """Id of any character not in the training split."""
        return len(self.chars)

    @property
    def vocab_size(self) -> int:
        """Number of ids the model must embed: the characters plus the unknown id."""
        return len(self.chars) + 1

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned dtype that holds every id: uint8 up to 256 ids, else uint16."""
        if self.vocab_size <= 1 << 8:
            return np.dtype(np.uint8)
        if self.vocab_size <= 1 << 16:
            return np.dtype(np.uint16)
        return np.dtype(np.uint32)

    def encode(self, text: str, out: np.ndarray | None = None) -> np.ndarray:
        """Ids of ``text`` (dtype :attr:`dtype`), into ``out`` if given (e.g. a memmap), chunk
        by chunk: the UTF-32 buffer stays bounded whatever the length."""
        if out is None:
            out = np.empty(len(text), dtype=self.dtype)
        elif out.shape != (len(text),):
            raise ValueError(f"out has shape {out.shape}, expected ({len(text)},)")
        pos = 0
        for piece in _chunks(text):
            out[pos : pos + len(piece)] = self._lut[_code_points(piece)]
            pos += len(piece)
        return out

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; the unknown id decodes to U+FFFD. Ids out of range are an error."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() > self.unknown_id):
            raise ValueError(f"ids must lie in [0, {self.unknown_id}]")
        table = _code_points(self.chars + UNKNOWN_CHAR)
        return table[arr].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")

    def digest(self) -> str:
        """Short SHA-256 of the characters: vocabularies of one size but other characters
        must not pass for one another when a run resumes."""
        return hashlib.sha256(self.chars.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """JSON-safe description stored in ``meta.json``."""
        return {"chars": self.chars, "unknown_id": self.unknown_id, "vocab_size": self.vocab_size}

    @classmethod
    def from_json(cls, obj: Any) -> CharVocab:
        """Inverse of :meth:`to_json`; raises QKGeomError on anything inconsistent."""
        if not isinstance(obj, dict) or not isinstance(obj.get("chars"), str):
            raise QKGeomError("vocabulary entry must be an object with a string 'chars'")
        vocab = cls(obj["chars"])
        for key in ("unknown_id", "vocab_size"):
            if key in obj and obj[key] != getattr(vocab, key):
                raise QKGeomError(f"vocabulary {key} {obj[key]!r} does not match its characters")
        return vocab
