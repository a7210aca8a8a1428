"""The monitor's probe set: token ids, batches or text, checked once at construction."""

from __future__ import annotations

import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.monitor.probe_input import probe_ids


def test_probe_inputs(corpus) -> None:
    ids = torch.arange(12).view(3, 4)
    assert torch.equal(probe_ids({"input_ids": ids, "attention_mask": torch.ones(3, 4)}), ids)
    assert probe_ids([1, 2, 3]).shape == (1, 3)
    text = "The cat sat on the mat. " * 20
    got = probe_ids(text, tokenizer=corpus.vocab, seq_len=10, n_seq=3)
    want = torch.from_numpy(corpus.vocab.encode(text)[:30].astype("int64")).view(3, 10)
    assert torch.equal(got, want)
    mask = torch.ones(3, 4)
    mask[0, 3] = 0
    with pytest.raises(QKGeomError, match="padded"):
        probe_ids({"input_ids": ids, "attention_mask": mask})
    with pytest.raises(QKGeomError, match="tokenizer"):
        probe_ids("some text")
    with pytest.raises(QKGeomError, match="integer"):
        probe_ids(torch.rand(2, 3))
    with pytest.raises(QKGeomError, match="context"):
        probe_ids(ids, max_positions=3)
