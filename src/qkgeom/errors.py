"""Errors the user can fix.

Anything raised as :class:`QKGeomError` is bad input (a missing file, an invalid config
value, a corrupt run folder): the CLI prints its message on one line and exits with code 2,
never a traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


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
