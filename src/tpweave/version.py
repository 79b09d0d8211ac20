"""tpweave's version (one place: the package, the CLI and pyproject read it)."""

__version__ = "0.1.0"
