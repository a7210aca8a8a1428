"""Corpora as memory-mapped character tokens: sources, vocabulary, windows, probe set.

``prepare_data`` turns a source (the offline Wikipedia sample, WikiText-103, any UTF-8
text, a Wikipedia dump) into ``train/val/test.bin`` + ``meta.json``; ``load_prepared``
memory-maps them back; ``sample_batch`` and ``probe_set`` read windows from them.
"""

from qkgeom.data.batches import probe_set, sample_batch
from qkgeom.data.prepare import (
    SOURCES,
    PreparedData,
    default_data_dir,
    ensure_sample_data,
    load_data,
    load_prepared,
    load_vocab,
    prepare_data,
)
from qkgeom.data.vocab import CharVocab
from qkgeom.data.wikidump import convert_dump, iter_articles

__all__ = ["SOURCES", "prepare_data", "load_prepared", "load_data", "load_vocab", "PreparedData",
           "CharVocab", "ensure_sample_data", "default_data_dir", "sample_batch", "probe_set",
           "convert_dump", "iter_articles"]
