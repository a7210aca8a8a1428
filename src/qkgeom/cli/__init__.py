"""``qkgeom`` command line: subcommands only; parse, validate, call the API, print.

One module per group of subcommands: :mod:`.data`, :mod:`.train` (``train``, ``show``),
:mod:`.runs` (``compare``, ``runs``), :mod:`.sweeps` (``sweep run|status``, ``reproduce``,
``report``), :mod:`.checkpoints` (``analyze``, ``export``), :mod:`.watch`; ``-h`` is
``--help`` everywhere. Exit codes: 0 done, 2 bad input, not enough
memory or a missing optional package (one line on stderr naming the extra), 3 diverged,
130 / 143 interrupted by SIGINT / SIGTERM (one line saying how to resume). Every message
goes through :func:`qkgeom.ui.printable`: text a file held cannot drive the terminal.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from qkgeom.cli import checkpoints, data, runs, sweeps, train, watch
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
        params = _plain_flags(super().get_params(ctx))
        # help generated when asked for (``reproduce``: from the registry of experiments,
        # which imports pandas: not at startup)
        generated = getattr(self.callback, "generated_help", None)
        if generated is not None:
            texts = generated()
            for param in params:
                param.help = texts.get(param.name or "", param.help)
        return params


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


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


def _finish(typer_app: typer.Typer) -> None:
    """Every command and group of ``typer_app`` (and its sub-apps) with plain flags
    (:class:`_Command`, :class:`_Group`) and carrying interrupts past typer."""
    typer_app.info.cls = _Group
    for command in typer_app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = _Command
        if command.callback is not None:
            command.callback = _carry_interrupts(command.callback)
    for group in typer_app.registered_groups:
        group.cls = _Group
        if group.typer_instance is not None:
            _finish(group.typer_instance)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Geometry of attention queries and keys.",
                  # -h as well as --help; every subcommand's context inherits it
                  context_settings={"help_option_names": ["-h", "--help"]})
for group in (data, train, runs, sweeps, checkpoints, watch):
    group.register(app)
_finish(app)


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
    """Entry point: errors the user can act on as one line and an exit code (typer's
    standalone mode already does so for usage errors: unknown option, bad choice)."""
    import warnings

    from qkgeom.errors import signals_interrupt
    from qkgeom.ui import printable

    # Warnings (e.g. "torn checkpoint, falling back") as one line, not file:line + source.
    warnings.formatwarning = lambda message, *_, **__: f"qkgeom: warning: {printable(message)}\n"
    try:
        with signals_interrupt():  # SIGTERM stops a command as Ctrl-C does, and says so
            app(args=argv, standalone_mode=True)
    except (Exception, KeyboardInterrupt, _Stopped) as err:
        line = _error_line(err.interrupt if isinstance(err, _Stopped) else err)
        if line is None:
            raise
        typer.echo(line[0], err=True)
        sys.exit(line[1])


def _error_line(err: BaseException) -> tuple[str, int] | None:
    """The line and exit code of an error the user can act on; None for a bug."""
    from qkgeom.errors import DivergedError, Interrupted, StorageError
    from qkgeom.ui import printable

    if isinstance(err, QKGeomError):
        return (f"qkgeom: {'' if isinstance(err, DivergedError) else 'error: '}"
                f"{printable(err)}", err.exit_code)
    if isinstance(err, ModuleNotFoundError):
        message = missing_package(err)
        return (f"qkgeom: error: {message}", QKGeomError.exit_code) if message else None
    if isinstance(err, OSError):  # a folder qkgeom may not create (read-only, full disk)
        if err.errno not in StorageError.ERRNOS:
            return None
        return (f"qkgeom: error: {printable(StorageError.of(err.filename or '?', err))}",
                StorageError.exit_code)
    if isinstance(err, (MemoryError, RuntimeError)):  # an allocation refused
        from qkgeom.training.resources import is_out_of_memory

        if not is_out_of_memory(err):
            return None
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return (f"qkgeom: error: out of memory ({type(err).__name__}{': ' if first else ''}"
                f"{first}); lower --batch-size or the context length", QKGeomError.exit_code)
    if isinstance(err, Interrupted):
        return (f"qkgeom: {printable(err.message or f'interrupted ({err.signal_name})')}",
                err.exit_code)
    return ("qkgeom: interrupted", 130) if isinstance(err, KeyboardInterrupt) else None
