"""Export a run's checkpoint as a Hugging Face ``GPT2LMHeadModel`` folder.

Our GPT is GPT-2's architecture with separate q/k/v projections and (by default) no
biases, so the conversion is exact: q/k/v are fused into ``c_attn`` (``[W_Q; W_K; W_V]``,
transposed for GPT-2's ``Conv1D``, which computes ``x @ W``), every linear weight is
transposed likewise, absent biases (LayerNorm's too) become zeros, GELU is the exact one
(``activation_function="gelu"``), LayerNorm eps 1e-5, and the embeddings stay tied.
Beside the weights: the character vocabulary (``qkgeom_vocab.json``) and a character-level
``tokenizer.json`` (one token per character, ``<unk>`` = our unknown id), so
``AutoTokenizer`` / TransformerLens / any HF tool can open the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qkgeom.errors import QKGeomError
from qkgeom.io import write_json

__all__ = ["char_tokenizer", "export_run", "to_gpt2"]

UNK = "<unk>"


def to_gpt2(model):
    """A ``GPT2LMHeadModel`` computing the same logits as our ``GPT``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    d = cfg.n_embd
    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=d, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * d, activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)
    hf = GPT2LMHeadModel(hf_cfg).eval()

    def bias(lin: torch.nn.Module, n: int) -> torch.Tensor:
        b = getattr(lin, "bias", None)
        return b.detach().clone() if b is not None else torch.zeros(n)

    with torch.no_grad():
        tr = hf.transformer
        tr.wte.weight.copy_(model.wte.weight)
        tr.wpe.weight.copy_(model.wpe.weight)
        for blk, h in zip(model.blocks, tr.h, strict=True):
            a = blk.attn
            h.ln_1.weight.copy_(blk.ln_1.weight)
            h.ln_1.bias.copy_(bias(blk.ln_1, d))
            h.attn.c_attn.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                  a.v_proj.weight], dim=0).T)  # (d, 3d)
            h.attn.c_attn.bias.copy_(torch.cat([bias(a.q_proj, d), bias(a.k_proj, d),
                                                bias(a.v_proj, d)]))
            h.attn.c_proj.weight.copy_(a.c_proj.weight.T)
            h.attn.c_proj.bias.copy_(bias(a.c_proj, d))
            h.ln_2.weight.copy_(blk.ln_2.weight)
            h.ln_2.bias.copy_(bias(blk.ln_2, d))
            h.mlp.c_fc.weight.copy_(blk.mlp.c_fc.weight.T)  # (d, 4d)
            h.mlp.c_fc.bias.copy_(bias(blk.mlp.c_fc, 4 * d))
            h.mlp.c_proj.weight.copy_(blk.mlp.c_proj.weight.T)  # (4d, d)
            h.mlp.c_proj.bias.copy_(bias(blk.mlp.c_proj, d))
        tr.ln_f.weight.copy_(model.ln_f.weight)
        tr.ln_f.bias.copy_(bias(model.ln_f, d))
    hf.tie_weights()
    return hf


def char_tokenizer(vocab):
    """A ``PreTrainedTokenizerFast`` giving exactly ``vocab.encode`` ids (one per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {ch: i for i, ch in enumerate(vocab.chars)}
    table[UNK] = vocab.unknown_id
    tok = Tokenizer(models.WordLevel(table, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=UNK,
                                   eos_token=UNK)


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run's checkpoint at ``step`` (default: newest) to ``out`` as a
    ``GPT2LMHeadModel`` folder with its character vocabulary; returns ``out``."""
    from qkgeom.pretrained.checkpoints import load_run_model, require_transformers

    require_transformers()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise QKGeomError(f"{out} exists and is not empty; choose another --out")
    model, vocab, step = load_run_model(run_dir, step)
    if model.config.dropout:
        model.eval()
    hf = to_gpt2(model.float())
    hf.save_pretrained(out)
    char_tokenizer(vocab).save_pretrained(out)
    write_json(out / "qkgeom_vocab.json", {**vocab.to_json(), "run": str(Path(run_dir)),
                                           "step": step})
    write_json(out / "trainer_state.json", {"global_step": step})
    return out
