"""``qkgeom`` command line: subcommands only; parse, validate, call the API, print.

One module per group of subcommands: :mod:`.data` (``data prepare``), :mod:`.train`
(``train``, ``show``), :mod:`.sweeps` (``sweep run|status``, ``reproduce e1|e3``,
``report``), :mod:`.checkpoints` (``analyze``, ``export``), :mod:`.watch` (``watch``).

Exit codes: 0 done, 2 bad input, not enough memory or a missing optional package (one
line on stderr, no traceback; a missing package names the extra that brings it), 3
diverged, 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (one line saying where the
run stopped and how to resume it). Every line printed from a message goes through
:func:`qkgeom.ui.printable`: text a file held cannot drive the terminal.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from qkgeom.cli import checkpoints, data, sweeps, train, watch
from qkgeom.errors import QKGeomError
from qkgeom.version import __version__

__all__ = ["EXTRAS", "app", "main"]

#: Optional packages -> the qkgeom extra that installs them (pyproject.toml); the
#: packages those bring (huggingface_hub, safetensors with transformers) name it too.
EXTRAS = {"scipy": "report", "matplotlib": "report", "markdown": "report",
          "transformers": "hf", "tokenizers": "hf", "huggingface_hub": "hf",
          "safetensors": "hf", "datasets": "data", "tensorboard": "tensorboard",
          "ray": "ray"}
#: Optional packages no extra brings: how to install them.
OWN_INSTALL = {"wandb": "pip install wandb",
               "lightning": "pip install lightning", "pytorch_lightning": "pip install lightning"}



def _plain_flags(params: list[Any]) -> list[Any]:
    """Flags (``--resume``, ``--help``) take no value, so their help shows no value type:
    typer's rich help prints one for every option (``<bool>``) unless a metavar is set."""
    for param in params:
        if getattr(param, "is_flag", False) and not getattr(param, "count", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


def _use_plain_flags(typer_app: typer.Typer) -> None:
    """Every command and group of ``typer_app`` (and its sub-apps) as :class:`_Command`
    and :class:`_Group`."""
    typer_app.info.cls = _Group
    for command in typer_app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = _Command
    for group in typer_app.registered_groups:
        group.cls = _Group
        if group.typer_instance is not None:
            _use_plain_flags(group.typer_instance)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Geometry of attention queries and keys.")
for group in (data, train, sweeps, checkpoints, watch):
    group.register(app)
_use_plain_flags(app)


class _Stopped(BaseException):
    """An interrupt carried past typer, which would turn it into a silent exit 130: main
    prints its line (where the run stopped, how to resume) and exits with its code."""

    def __init__(self, interrupt: KeyboardInterrupt) -> None:
        super().__init__(str(interrupt))
        self.interrupt = interrupt


def _carry_interrupts(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)  # typer reads the parameters through __wrapped__
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as err:
            raise _Stopped(err) from None

    return run


def _wrap_commands(typer_app: typer.Typer) -> None:
    for info in typer_app.registered_commands:
        if info.callback is not None:
            info.callback = _carry_interrupts(info.callback)
    for sub in typer_app.registered_groups:
        if sub.typer_instance is not None:
            _wrap_commands(sub.typer_instance)


_wrap_commands(app)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"qkgeom {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False) -> None:
    """Geometry of attention queries and keys: train, measure, monitor, report."""


def missing_package(err: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional package that is not installed (None for a
    module no extra provides: that is a bug, shown as one)."""
    top = (err.name or "").split(".")[0]
    if top in OWN_INSTALL:
        return f"this needs the {top} package: {OWN_INSTALL[top]}"
    if top not in EXTRAS:
        return None
    return f"this needs the {top} package: pip install 'qkgeom[{EXTRAS[top]}]'"


def main(argv: list[str] | None = None) -> None:
    """Entry point: turn user errors into one line and an exit code.

    Typer's standalone mode already reports usage errors (unknown option, bad choice) as a
    short message with exit code 2; errors the user can fix raised from inside a command
    (:class:`QKGeomError`) are caught here.
    """
    import warnings

    from qkgeom.errors import DivergedError, Interrupted, StorageError, signals_interrupt
    from qkgeom.ui import printable

    # Warnings (e.g. "torn checkpoint, falling back") as one line, not file:line + source.
    warnings.formatwarning = lambda message, *_, **__: f"qkgeom: warning: {printable(message)}\n"
    try:
        with signals_interrupt():  # SIGTERM stops a command as Ctrl-C does, and says so
            app(args=argv, standalone_mode=True)
    except DivergedError as err:
        typer.echo(f"qkgeom: {printable(err)}", err=True)
        sys.exit(err.exit_code)
    except QKGeomError as err:
        typer.echo(f"qkgeom: error: {printable(err)}", err=True)
        sys.exit(err.exit_code)
    except ModuleNotFoundError as err:
        message = missing_package(err)
        if message is None:
            raise
        typer.echo(f"qkgeom: error: {message}", err=True)
        sys.exit(QKGeomError.exit_code)
    except OSError as err:  # a folder qkgeom may not create (read-only, full disk)
        if err.errno not in StorageError.ERRNOS:
            raise
        typer.echo(f"qkgeom: error: {printable(StorageError.of(err.filename or '?', err))}",
                   err=True)
        sys.exit(StorageError.exit_code)
    except (MemoryError, RuntimeError) as err:  # an allocation the host or device refused
        from qkgeom.training.resources import is_out_of_memory

        if not is_out_of_memory(err):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        typer.echo(f"qkgeom: error: out of memory ({type(err).__name__}{': ' if first else ''}"
                   f"{first}); lower --batch-size or the context length", err=True)
        sys.exit(QKGeomError.exit_code)
    except (KeyboardInterrupt, _Stopped) as caught:
        err = caught.interrupt if isinstance(caught, _Stopped) else caught
        if isinstance(err, Interrupted):
            typer.echo(f"qkgeom: {printable(err.message or f'interrupted ({err.signal_name})')}",
                       err=True)
            sys.exit(err.exit_code)
        typer.echo("qkgeom: interrupted", err=True)
        sys.exit(130)
