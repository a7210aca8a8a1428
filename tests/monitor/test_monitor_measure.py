"""One probe: same numbers as the project's own probe, key spectra, metric names, inputs."""

from __future__ import annotations

import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES
from qkgeom.monitor.measure import measure, resolve_metrics
from qkgeom.monitor.probe_input import probe_ids
from qkgeom.pretrained.adapters import find_attention_sites

from .conftest import T, tiny_gpt2


def test_project_gpt_matches_the_trainers_probe(probe_tokens) -> None:
    """Ground truth: qkgeom.geometry.probe (what qkgeom.train records) on the same model."""
    from qkgeom import GPT, GPTConfig
    from qkgeom.geometry.probe import probe

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=256))
    got = measure(model, find_attention_sites(model), probe_tokens, METRIC_NAMES).frame
    want = probe(model, probe_tokens)
    both = got.merge(want, on=["layer", "head", "metric"], suffixes=("", "_want"))
    assert len(both) == len(want) == len(got)
    assert (both["value"] - both["value_want"]).abs().max() < 1e-5


def test_key_spectra_of_gpt2_match_weights_and_cached_keys(corpus, probe_tokens) -> None:
    model = tiny_gpt2(corpus.vocab.vocab_size).eval()
    probe = measure(model, find_attention_sites(model), probe_tokens, ("pr_k_token",),
                    spectra=True)
    d = model.config.n_embd
    with torch.no_grad():
        cache = model(input_ids=probe_tokens, use_cache=True).past_key_values
    for layer, block in enumerate(model.transformer.h):
        w_k = block.attn.c_attn.weight[:, d:2 * d].double()  # (d, d_k), y = x @ W
        assert torch.allclose(probe.key_sv_weight[layer], torch.linalg.svdvals(w_k), rtol=1e-6)
        keys = cache.layers[layer].keys  # (B, H, T, hd), GPT-2: no rotary
        k = keys.permute(0, 2, 1, 3).reshape(-1, d).double()  # (B·T, d_k)
        want = torch.linalg.eigvalsh(torch.cov(k.T)).flip(0)
        assert torch.allclose(probe.key_eig_token[layer], want, rtol=1e-4, atol=1e-9)
    assert set(probe.frame["metric"]) == {"pr_k_token"}


def test_grouped_query_attention_pairs_query_heads_with_their_key_head() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, intermediate_size=64, vocab_size=50,
                                   max_position_embeddings=T, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(0))
    frame = measure(model, find_attention_sites(model), ids, ("pr_k_token",)).frame
    pr_k = frame[frame["head"] >= 0].set_index("head")["value"]
    assert pr_k[0] == pr_k[1] and pr_k[2] == pr_k[3] and pr_k[0] != pr_k[2]


def test_metric_names() -> None:
    assert resolve_metrics(["pr_q_token", "contrast", "contrast_token"]) == (
        "pr_q_token", "contrast_token")
    assert resolve_metrics("all") == METRIC_NAMES
    with pytest.raises(QKGeomError, match="unknown metric 'pr_v'"):
        resolve_metrics(["pr_v"])


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
