"""Padded batches: ``measure(..., attention_mask=)`` and ``LayerGeometry.update(lengths=)``
give each sequence the numbers it gets unpadded, alone (right and left padding; our GPT,
HF GPT-2, HF BERT, HF Llama; causal and bidirectional), and a mask of ones is the unpadded
path."""

from __future__ import annotations

import pytest
import torch
from hf_models import build

from qkgeom import GPT, GPTConfig, measure
from qkgeom.errors import QKGeomError
from qkgeom.geometry import LayerGeometry, measure_batches
from qkgeom.geometry.padding import check_mask

LENGTHS = (16, 9, 13, 9, 1, 5)  # equal lengths share a group; a one-token sequence
T = 16
PAD = 0


def sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(seqs), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[i, where], mask[i, where] = s, 1
    return ids, mask


def our_gpt() -> GPT:
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=40)
    return GPT(cfg, generator=torch.Generator().manual_seed(0))


MODELS = {"gpt": our_gpt, "gpt2": lambda: build("gpt2"), "bert": lambda: build("bert"),
          "llama": lambda: build("llama")}  # llama: rotary positions and GQA


def assert_same_numbers(got, want, rtol: float = 1e-9) -> None:
    keys = ["layer", "head", "metric"]
    assert got[keys].equals(want[keys])
    torch.testing.assert_close(torch.tensor(got["value"].values),
                               torch.tensor(want["value"].values), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_a_padded_batch_gives_the_numbers_of_each_sequence_alone(arch: str, side: str) -> None:
    model = MODELS[arch]().double()  # float64 forward: the comparison is to round-off
    seqs = sequences(40)
    alone = measure_batches(model, [s[None] for s in seqs])  # unpadded, one by one
    ids, mask = padded(seqs, side)
    got = measure(model, ids, attention_mask=mask, batch_size=4)
    assert_same_numbers(got.frame, alone.frame)
    assert (got.tokens, got.sequences) == (sum(LENGTHS), len(LENGTHS)) == (alone.tokens, 6)
    # the mask matters: read as unpadded, the padding changes every token metric
    unmasked = measure(model, ids, batch_size=4).frame
    token_rows = ~unmasked["metric"].str.contains("weight")
    assert not (unmasked["value"][token_rows] - alone.frame["value"][token_rows]).abs().lt(
        1e-6).all()


def test_an_hf_tokenizer_batch_goes_to_measure_batches_as_it_is() -> None:
    model = build("bert").double()
    seqs = sequences(40)
    ids, mask = padded(seqs, "right")
    batches = [{"input_ids": ids[:3], "attention_mask": mask[:3]},
               {"input_ids": ids[3:], "attention_mask": mask[3:]}]
    got = measure_batches(model, batches)
    assert_same_numbers(got.frame, measure_batches(model, [s[None] for s in seqs]).frame)
    assert got.tokens == sum(LENGTHS)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_a_mask_of_ones_is_the_unpadded_path_bit_for_bit(arch: str) -> None:
    model = MODELS[arch]()
    ids = torch.randint(3, 40, (5, T), generator=torch.Generator().manual_seed(1))
    plain = measure(model, ids, batch_size=2).frame
    assert measure(model, ids, attention_mask=torch.ones(5, T), batch_size=2).frame.equals(plain)
    batch = {"input_ids": ids, "attention_mask": torch.ones(5, T, dtype=torch.long)}
    assert measure_batches(model, [batch]).frame.equals(measure_batches(model, [ids]).frame)


@pytest.mark.parametrize("causal", [True, False])
def test_layer_geometry_counts_only_the_real_tokens(causal: bool) -> None:
    """Random q/k with GQA (4 query heads, 2 key heads): a right-padded batch with
    ``lengths`` equals each sequence added alone; garbage in the padding changes nothing."""
    g = torch.Generator().manual_seed(0)
    B, H, Hk, hd = len(LENGTHS), 4, 2, 8
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        q[b, :, n:], k[b, :, n:] = 1e3, -1e3  # padding: loud, so any leak shows
    alone = LayerGeometry(H, Hk, hd, causal)
    for b, n in enumerate(LENGTHS):
        alone.update(q[b:b + 1, :, :n], k[b:b + 1, :, :n])
    geo = LayerGeometry(H, Hk, hd, causal)
    geo.update(q, k, lengths=torch.tensor(LENGTHS))
    assert (geo.n_tokens, geo.n_sequences) == (sum(LENGTHS), B)
    for (head, metric, value), (head_a, metric_a, value_a) in zip(
            geo.records(), alone.records(), strict=True):  # (head, metric, value)
        assert (head, metric) == (head_a, metric_a)
        assert value == pytest.approx(value_a, rel=1e-10, abs=1e-12), metric
    whole = LayerGeometry(H, Hk, hd, causal)
    whole.update(q, k)
    full = LayerGeometry(H, Hk, hd, causal)
    full.update(q, k, lengths=[T] * B)  # nothing padded: the unpadded path itself
    assert full.records() == whole.records()
    with pytest.raises(ValueError, match="lengths"):
        geo.update(q, k, lengths=[0] * B)


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 3), "shape"),
    (torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), "no real token"),
    (torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), "padding between real tokens"),
    (torch.tensor([[1, 1, 2, 1], [1, 1, 1, 1]]), "only 0"),
])
def test_masks_it_cannot_measure_get_one_line(mask: torch.Tensor, message: str) -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(QKGeomError, match=message) as err:
        measure(our_gpt(), ids, attention_mask=mask)
    assert "\n" not in str(err.value)
    both_sides = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])  # left and right: one run
    assert check_mask(ids, both_sides) is not None and check_mask(ids, torch.ones(2, 4)) is None
