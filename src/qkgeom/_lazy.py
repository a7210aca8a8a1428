"""Lazy package exports: a name is imported from its module on first use.

Why: ``import qkgeom.analysis`` or ``qkgeom watch`` must not pay for importing torch or
transformers just because the package's ``__init__`` re-exports model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a public name to the
    module defining it; the loaded value is cached in ``namespace`` (the package's
    ``globals()``), so the lookup runs once per name."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
