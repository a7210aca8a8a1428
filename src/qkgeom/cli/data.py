"""``qkgeom data prepare``: corpora into memory-mapped character tokens."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Source(str, Enum):
    sample = "sample"
    wikitext_103 = "wikitext-103"
    text = "text"
    wikidump = "wikidump"


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(no_args_is_help=True, help="Prepare corpora into token arrays.")
    app.add_typer(data_app, name="data")

    @data_app.command("prepare")
    def data_prepare(
        dir: Annotated[Path, typer.Option("--dir", help="Output folder for the token arrays.")],
        source: Annotated[Source, typer.Option(help="Corpus to prepare.")] = Source.sample,
        path: Annotated[Path | None, typer.Option(
            help="Input: WikiText raw folder (omit to use the `datasets` copy), a text file "
                 "or folder, or a Wikipedia *.xml.bz2 dump.")] = None,
        force: Annotated[bool, typer.Option(
            help="Replace prepared data of another corpus in --dir, or write beside files "
                 "that are not prepared data (they are never deleted).")] = False,
    ) -> None:
        """Prepare a corpus as memory-mapped character tokens plus meta.json."""
        from qkgeom.data import load_prepared, prepare_data

        out = prepare_data(source.value, dir, path=path, force=force)
        data = load_prepared(out)
        sizes = ", ".join(f"{k} {len(getattr(data, k)):,}" for k in ("train", "val", "test"))
        typer.echo(f"prepared {source.value} into {out}: vocab {data.vocab.vocab_size}, "
                   f"tokens {sizes}")
