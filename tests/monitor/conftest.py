"""Tiny character-level GPT-2s on the embedded Wikipedia text (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

T = 32  # context of the tiny models and length of the probe / training windows


@pytest.fixture(scope="session")
def corpus(sample_data: Path):
    """The prepared embedded sample: ``.train``/``.val`` token memmaps and ``.vocab``."""
    from qkgeom.data import load_prepared

    return load_prepared(sample_data)


@pytest.fixture(scope="session")
def probe_tokens(corpus) -> torch.Tensor:
    """The fixed probe set: the first 4 × T tokens of the val split."""
    from qkgeom.data import probe_set

    return probe_set(corpus.val, 4, T)


@pytest.fixture(scope="session")
def train_windows(corpus) -> torch.Tensor:
    """64 fixed training windows (64, T) from the train split."""
    start = np.arange(64) * 997
    rows = [np.asarray(corpus.train[s:s + T], dtype=np.int64) for s in start]
    return torch.from_numpy(np.stack(rows))


def tiny_gpt2(vocab_size: int, seed: int = 0, n_layer: int = 2, n_embd: int = 32,
              n_head: int = 2) -> torch.nn.Module:
    """A fresh GPT-2 LM (dropout on, so RNG use in training is real)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                  vocab_size=vocab_size, n_positions=T, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)
