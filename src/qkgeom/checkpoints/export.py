"""Export a run's checkpoint as a Hugging Face ``GPT2LMHeadModel`` folder.

The conversion is exact (:func:`qkgeom.arch.gpt.to_gpt2`). Beside the weights: the character vocabulary (``qkgeom_vocab.json``) and a character-level
``tokenizer.json`` (one token per character, ``<unk>`` = our unknown id), so
``AutoTokenizer`` / TransformerLens / any HF tool can open the run.
"""

from __future__ import annotations

from pathlib import Path

from qkgeom.errors import QKGeomError
from qkgeom.io import write_json

__all__ = ["char_tokenizer", "export_run"]

UNK = "<unk>"


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
    from qkgeom.arch.gpt import to_gpt2
    from qkgeom.checkpoints.resolve import load_run_model, require_transformers

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
