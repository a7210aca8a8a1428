"""``python -m qkgeom.cli``: the same as the ``qkgeom`` command."""

from qkgeom.cli import main

main()
