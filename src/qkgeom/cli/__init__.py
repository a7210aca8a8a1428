"""``qkgeom`` command line: subcommands only; parse, validate, call the API, print.

One module per group of subcommands: :mod:`.data` (``data prepare``), :mod:`.train`
(``train``, ``show``), :mod:`.sweeps` (``sweep run|status``, ``reproduce e1|e3``,
``report``), :mod:`.checkpoints` (``analyze``, ``export``), :mod:`.watch` (``watch``).

Exit codes: 0 done, 2 bad input or not enough memory (one line on stderr, no traceback),
3 diverged, 130 interrupted.
"""

from __future__ import annotations

import sys

import typer

from qkgeom.cli import checkpoints, data, sweeps, train, watch
from qkgeom.errors import QKGeomError

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Geometry of attention queries and keys.")
for group in (data, train, sweeps, checkpoints, watch):
    group.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: turn user errors into one line and an exit code.

    Typer's standalone mode already reports usage errors (unknown option, bad choice) as a
    short message with exit code 2; errors the user can fix raised from inside a command
    (:class:`QKGeomError`) are caught here.
    """
    import warnings

    from qkgeom.errors import DivergedError, StorageError

    # Warnings (e.g. "torn checkpoint, falling back") as one line, not file:line + source.
    warnings.formatwarning = lambda message, *_, **__: f"qkgeom: warning: {message}\n"
    try:
        app(args=argv, standalone_mode=True)
    except DivergedError as err:
        typer.echo(f"qkgeom: {err}", err=True)
        sys.exit(err.exit_code)
    except QKGeomError as err:
        typer.echo(f"qkgeom: error: {err}", err=True)
        sys.exit(err.exit_code)
    except OSError as err:  # a folder qkgeom may not create (read-only, full disk)
        if err.errno not in StorageError.ERRNOS:
            raise
        typer.echo(f"qkgeom: error: {StorageError.of(err.filename or '?', err)}", err=True)
        sys.exit(StorageError.exit_code)
    except (MemoryError, RuntimeError) as err:  # an allocation the host or device refused
        from qkgeom.training.resources import is_out_of_memory

        if not is_out_of_memory(err):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        typer.echo(f"qkgeom: error: out of memory ({type(err).__name__}{': ' if first else ''}"
                   f"{first}); lower --batch-size or the context length", err=True)
        sys.exit(QKGeomError.exit_code)
    except KeyboardInterrupt:
        typer.echo("qkgeom: interrupted", err=True)
        sys.exit(130)
