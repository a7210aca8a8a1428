"""Tiny Hugging Face models of every supported architecture, built from configs, and
families of "revisions" saved to disk (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

V = 96  # vocabulary of the tiny models (the tokenizer below uses the first ids of it)
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "\n") * 60
SPECIALS = ("[UNK]", "[CLS]", "[SEP]")


def char_tokenizer():
    """A real Hugging Face tokenizer (``PreTrainedTokenizerFast`` over a ``tokenizers``
    word-level model): one token per character of :data:`TEXT`, ``[UNK]`` for any other
    character, and ``[CLS]``/``[SEP]``, which the analysis puts around an encoder's windows.
    Saved into each family folder, where ``AutoTokenizer`` loads it as it would a hub
    model's."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *sorted(set(TEXT))])}
    assert len(vocab) <= V
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def build(arch: str, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """A 2-layer model of ``arch`` with random (seeded) weights."""
    torch.manual_seed(seed)
    common = {"vocab_size": V, "attn_implementation": attn}
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2Model(cfg).eval()
    if arch == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=4,
                                         num_hidden_layers=2, intermediate_size=64,
                                         max_position_embeddings=128, rotary_pct=0.5, **common)
        return transformers.GPTNeoXModel(cfg).eval()
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2,
                                       intermediate_size=64, max_position_embeddings=128,
                                       **common)
        return transformers.LlamaModel(cfg).eval()
    if arch == "bert":
        cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                      intermediate_size=64, max_position_embeddings=128,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      **common)
        return transformers.BertModel(cfg).eval()
    raise ValueError(arch)


ARCHS = ("gpt2", "gpt_neox", "llama", "bert")


def save_family(root: Path, arch: str, steps: list[int], duplicate: dict[int, int] | None = None
                ) -> list[Path]:
    """Save ``step<N>`` folders of ``arch`` with the tokenizer: each step has its own
    weights (seed = step), except ``duplicate = {step: same_as_step}``."""
    duplicate = duplicate or {}
    tokenizer = char_tokenizer()
    out = []
    for step in steps:
        model = build(arch, seed=duplicate.get(step, step))
        folder = root / f"step{step}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out.append(folder)
    return out


def write_trainer_state(folder: Path, step: int) -> None:
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
