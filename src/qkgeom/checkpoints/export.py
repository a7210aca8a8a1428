"""Export a run's checkpoint as a Hugging Face ``GPT2LMHeadModel`` folder.

The conversion is exact (:func:`qkgeom.arch.gpt.to_gpt2`); beside the weights go the
character vocabulary and a character-level ``tokenizer.json``, so any HF tool opens the run.
The tokenizer's ``model_max_length`` is the context and it truncates from the left (the
characters a continuation depends on), so a long prompt never indexes past the position
table; no generation ``max_length`` is written (every ``max_new_tokens`` call would warn).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.io import write_json

__all__ = ["char_tokenizer", "export_run"]

UNK = "<unk>"


def char_tokenizer(vocab: Any, max_length: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` giving exactly ``vocab.encode`` ids (one per character);
    ``max_length``: the model's context (``model_max_length``, truncation from the left)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {ch: i for i, ch in enumerate(vocab.chars)}
    table[UNK] = vocab.unknown_id
    tok = Tokenizer(models.WordLevel(table, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    limits: dict[str, Any] = ({} if max_length is None else
                              {"model_max_length": max_length, "truncation_side": "left"})
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=UNK,
                                   eos_token=UNK, pad_token=UNK, **limits)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars for the block: the command prints one line."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run's checkpoint at ``step`` (default: newest) to ``out`` as a
    ``GPT2LMHeadModel`` folder with its character tokenizer; returns ``out``."""
    from qkgeom.arch.gpt import to_gpt2
    from qkgeom.checkpoints.resolve import load_run_model, require_transformers

    require_transformers()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder; choose another --out")
    if out.exists() and any(out.iterdir()):
        raise QKGeomError(f"{out} exists and is not empty; choose another --out")
    model, vocab, step = load_run_model(run_dir, step)
    if model.config.dropout:
        model.eval()
    context = model.config.block_size
    hf = to_gpt2(model.float())
    hf.generation_config.pad_token_id = vocab.unknown_id  # no "setting pad_token_id" notice
    with _no_progress_bars():
        hf.save_pretrained(out)
        char_tokenizer(vocab, context).save_pretrained(out)
    write_json(out / "qkgeom_vocab.json", {**vocab.to_json(), "run": str(Path(run_dir)),
                                           "step": step, "context": context})
    write_json(out / "trainer_state.json", {"global_step": step})
    return out
