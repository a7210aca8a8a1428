"""Errors the user can fix: a :class:`QKGeomError` is bad input (a missing file, an invalid
config value, a corrupt run folder), printed by the CLI on one line with exit code 2, never
a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import threading
from collections.abc import Iterator


class QKGeomError(Exception):
    """Bad input or state the user can fix; the CLI shows ``str(err)`` and exits 2."""

    exit_code = 2


def require_whole(name: str, value: object, minimum: int = 1) -> None:
    """QKGeomError unless ``value`` is an int (not a bool) >= ``minimum``; ``name`` is what
    the user set (a CLI flag)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise QKGeomError(f"{name} must be a whole number >= {minimum}, got {value!r}")


def first_line(err: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters of it) of an error
    a library raised, for a one-line QKGeomError."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:limit]}"


class DivergedError(QKGeomError):
    """Training produced a non-finite loss; the run is recorded as ``diverged`` (exit 3)."""

    exit_code = 3


class StorageError(QKGeomError):
    """A result file could not be written (disk full, read-only, no permission); the write
    was atomic, so the file it would have replaced is intact."""

    ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                        errno.EFBIG})

    @classmethod
    def of(cls, path: object, err: OSError) -> StorageError:
        reason = err.strerror or type(err).__name__
        return cls(f"{path}: cannot write ({reason}); the previous version of the file is "
                   "intact: free disk space or fix permissions, then resume (--resume, or "
                   "run the sweep again)")


class Interrupted(KeyboardInterrupt):
    """A stop asked for by SIGINT (Ctrl-C) or SIGTERM (a scheduler): a ``KeyboardInterrupt``,
    so code that stops cleanly on Ctrl-C does on SIGTERM too; the CLI exits ``128 + signum``
    as a shell reports it, printing ``message``."""

    def __init__(self, signum: int = signal.SIGINT, message: str = "") -> None:
        super().__init__(message)
        self.signum = int(signum)
        self.message = message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block SIGTERM and SIGINT raise :class:`Interrupted` in the main thread, so
    a run a scheduler stops records its state as on Ctrl-C; someone else's handler is left
    alone, and off the main thread (signals never arrive there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {}
    for sig, default in defaults.items():
        if signal.getsignal(sig) in (default, _raise_interrupted):
            previous[sig] = signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
