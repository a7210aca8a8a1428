"""The package version: one definition, read by ``qkgeom.__version__``, the run records and
the packaging (pyproject's dynamic version)."""

__version__ = "0.1.0"
