"""Errors the user can fix.

Anything raised as :class:`QKGeomError` is bad input (a missing file, an invalid config
value, a corrupt run folder): the CLI prints its message on one line and exits with code 2,
never a traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class QKGeomError(Exception):
    """Bad input or state the user can fix; the CLI shows ``str(err)`` and exits 2."""

    exit_code = 2


class DivergedError(QKGeomError):
    """Training produced a non-finite loss; the run is recorded as ``diverged`` (exit 3)."""

    exit_code = 3
