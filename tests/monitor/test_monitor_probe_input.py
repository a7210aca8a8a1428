"""The monitor's probe set: token ids, batches (padded ones too) or text, checked once at
construction."""

from __future__ import annotations

import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.monitor.probe_input import probe_batch


def test_probe_inputs(corpus) -> None:
    ids = torch.arange(12).view(3, 4)
    got, mask = probe_batch({"input_ids": ids, "attention_mask": torch.ones(3, 4)})
    assert torch.equal(got, ids) and mask is None  # a mask of ones pads nothing
    assert probe_batch([1, 2, 3])[0].shape == (1, 3)
    text = "The cat sat on the mat. " * 20
    got, mask = probe_batch(text, tokenizer=corpus.vocab, seq_len=10, n_seq=3)
    want = torch.from_numpy(corpus.vocab.encode(text)[:30].astype("int64")).view(3, 10)
    assert torch.equal(got, want) and mask is None
    with pytest.raises(QKGeomError, match="tokenizer"):
        probe_batch("some text")
    with pytest.raises(QKGeomError, match="integer"):
        probe_batch(torch.rand(2, 3))
    with pytest.raises(QKGeomError, match="context"):
        probe_batch(ids, max_positions=3)


def test_a_padded_batch_keeps_its_mask() -> None:
    ids = torch.arange(12).view(3, 4)
    mask = [[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1]]  # right, left, none (a nested list)
    got, kept = probe_batch({"input_ids": ids, "attention_mask": mask})
    assert torch.equal(got, ids) and torch.equal(kept, torch.tensor(mask, dtype=torch.bool))
    with pytest.raises(QKGeomError, match="padding between real tokens"):
        probe_batch({"input_ids": ids, "attention_mask": [[1, 0, 1, 1]] * 3})
    with pytest.raises(QKGeomError, match="shape"):
        probe_batch({"input_ids": ids, "attention_mask": torch.ones(3, 5)})


def test_text_windows_framed_by_special_tokens_on_request() -> None:
    from hf_models import TEXT, char_tokenizer

    tok = char_tokenizer()
    plain, _ = probe_batch(TEXT, tokenizer=tok, seq_len=10, n_seq=3)
    framed, _ = probe_batch(TEXT, tokenizer=tok, seq_len=10, n_seq=3, special_tokens=True)
    assert framed.shape == (3, 12)
    assert (framed[:, 0] == tok.cls_token_id).all() and (framed[:, -1] == tok.sep_token_id).all()
    assert torch.equal(framed[:, 1:-1], plain)  # the same text windows inside
    assert not torch.isin(plain, torch.tensor([tok.cls_token_id, tok.sep_token_id])).any()
    default, _ = probe_batch(TEXT, tokenizer=tok, max_positions=64, special_tokens=True)
    assert default.shape[1] == 64  # the default length counts the special tokens in
    with pytest.raises(QKGeomError, match="context"):
        probe_batch(TEXT, tokenizer=tok, seq_len=63, max_positions=64, special_tokens=True)
