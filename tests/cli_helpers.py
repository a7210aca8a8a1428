"""The CLI in this process (no interpreter start): for tests of exit codes and messages."""

from __future__ import annotations

import pytest


def in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``qkgeom.cli.main(args)`` in this process: (exit code, stdout, stderr)."""
    from qkgeom.cli import main

    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
