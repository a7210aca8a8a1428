"""CharVocab: sorted training characters plus an explicit unknown id."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkgeom.data import CharVocab
from qkgeom.data import vocab as vocab_mod
from qkgeom.errors import QKGeomError


def test_chars_sorted_unknown_is_last():
    v = CharVocab.from_text("banana\n")
    assert v.chars == "\nabn"
    assert (v.vocab_size, v.unknown_id, v.dtype) == (5, 4, np.dtype(np.uint8))
    assert v.encode("nab?").tolist() == [3, 1, 2, 4]
    assert v.decode([3, 1, 2, 4]) == "nab\ufffd"


def test_dtype_boundary():
    assert CharVocab("".join(map(chr, range(255)))).dtype == np.uint8  # 255 chars + unknown = 256
    assert CharVocab("".join(map(chr, range(256)))).dtype == np.uint16


@settings(max_examples=30, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_round_trip_any_text(text: str):
    v = CharVocab.from_text(text)
    ids = v.encode(text)
    assert ids.dtype == v.dtype and len(ids) == len(text)
    assert v.decode(ids) == text
    assert int(ids.max()) < v.unknown_id


def test_chunked_encode_matches(monkeypatch):
    text = "héllo wörld 𐀊 " * 50
    v = CharVocab.from_text(text)
    whole = v.encode(text)
    monkeypatch.setattr(vocab_mod, "ENCODE_CHUNK_CHARS", 7)
    assert CharVocab.from_text(text) == v
    assert np.array_equal(v.encode(text), whole)


def test_json_round_trip_and_validation():
    v = CharVocab.from_text("qkgeom ✓")
    assert CharVocab.from_json(v.to_json()) == v
    with pytest.raises(QKGeomError):
        CharVocab.from_json({"chars": "ba"})  # not sorted
    with pytest.raises(QKGeomError):
        CharVocab.from_json({"chars": "ab", "vocab_size": 7})
    with pytest.raises(QKGeomError):
        CharVocab.from_json(["a"])
