"""Errors the user can fix.

Anything raised as :class:`QKGeomError` is bad input (a missing file, an invalid config
value, a corrupt run folder): the CLI prints its message on one line and exits with code 2,
never a traceback. Everything else is a bug and keeps its traceback.
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


class DivergedError(QKGeomError):
    """Training produced a non-finite loss; the run is recorded as ``diverged`` (exit 3)."""

    exit_code = 3


class StorageError(QKGeomError):
    """A result file could not be written (disk full, read-only folder, no permission).

    The write was atomic, so the file it would have replaced (the last good checkpoint, the
    previous metrics) is intact; free space or fix permissions, then ``--resume``.
    """

    ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                        errno.EFBIG})

    @classmethod
    def of(cls, path: object, err: OSError) -> StorageError:
        reason = err.strerror or type(err).__name__
        return cls(f"{path}: cannot write ({reason}); the previous version of the file is "
                   "intact: free disk space or fix permissions, then resume (--resume, or "
                   "run the sweep again)")


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal (SIGINT: Ctrl-C; SIGTERM: a scheduler, ``kill``).

    A ``KeyboardInterrupt``, so code that already stops cleanly on Ctrl-C does the same on
    SIGTERM; the trainer records where the run stopped and raises it again with the line
    to print (``message``). The CLI exits with ``128 + signum`` (130, 143), as a shell
    reports a process ended by that signal."""

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
    """Within the block, SIGTERM (and SIGINT) raise :class:`Interrupted` in the main thread,
    so a run stopped by a scheduler records its state as one stopped by Ctrl-C does.
    A handler someone else installed is left alone; off the main thread this does nothing
    (Python delivers signals to the main thread only)."""
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
