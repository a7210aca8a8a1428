"""The monitor on padded batches and on encoders' text: a padded ``input_ids`` +
``attention_mask`` probe measures each sequence's real tokens as if alone, and text probes
of an encoder keep [CLS]/[SEP] unless ``special_tokens=False``."""

from __future__ import annotations

import pytest
import torch
from hf_models import TEXT, build, char_tokenizer

from qkgeom.geometry import measure_batches
from qkgeom.io import read_json
from qkgeom.monitor import GeometryMonitor

LENGTHS = (12, 7, 3, 12)


def padded_batch(side: str) -> tuple[dict, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in LENGTHS]
    ids = torch.zeros(len(seqs), 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(12 - len(s), 12)
        ids[i, where], mask[i, where] = s, 1
    return {"input_ids": ids, "attention_mask": mask}, seqs


@pytest.mark.parametrize("arch, side", [("bert", "right"), ("gpt2", "left")])
def test_a_padded_probe_batch_measures_the_real_tokens(arch: str, side: str, tmp_path) -> None:
    model = build(arch).double()
    batch, seqs = padded_batch(side)
    mon = GeometryMonitor(model, batch, every=1, metrics="all", out=tmp_path / "run",
                          tensorboard=None, wandb=False)
    probe = mon.start(0)
    mon.close()
    alone = measure_batches(model, [s[None] for s in seqs], metrics="all").frame
    torch.testing.assert_close(torch.tensor(probe.frame["value"].values),
                               torch.tensor(alone["value"].values), rtol=1e-9, atol=1e-12)
    assert probe.tokens == sum(LENGTHS)
    monitor = read_json(tmp_path / "run" / "config.json")["monitor"]
    assert monitor["probe_shape"] == [4, 12] and monitor["probe_tokens"] == sum(LENGTHS)


def test_encoder_text_probes_keep_special_tokens_unless_switched_off() -> None:
    tok = char_tokenizer()
    specials = torch.tensor([tok.cls_token_id, tok.sep_token_id])
    kw = {"tokenizer": tok, "seq_len": 20, "n_seq": 2, "tensorboard": None, "wandb": False}
    bert = GeometryMonitor(build("bert"), TEXT, **kw)
    assert bert.ids.shape == (2, 22)
    assert (bert.ids[:, 0] == tok.cls_token_id).all() and (bert.ids[:, -1] == tok.sep_token_id).all()
    bare = GeometryMonitor(build("bert"), TEXT, special_tokens=False, **kw)
    assert torch.equal(bare.ids, bert.ids[:, 1:-1]) and not torch.isin(bare.ids, specials).any()
    gpt2 = GeometryMonitor(build("gpt2"), TEXT, **kw)  # decoders: text tokens only
    assert torch.equal(gpt2.ids, bare.ids)
