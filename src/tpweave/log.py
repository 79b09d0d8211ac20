"""tpweave's logger ("tpweave"). Importing it installs no handler: an application configures logging
its own way, or calls `configure_from_env()` (the CLI, `launch`'s ranks and `tpweave.compile` do), which
reads TPWEAVE_LOG (debug, info, warning: debug prints each graph before and after each pass)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("tpweave")


def configure_from_env() -> None:
    """Give the tpweave logger a stderr handler at the level TPWEAVE_LOG names, when it is set and the
    logger has no handler yet; otherwise leave logging as the application set it."""
    level = os.environ.get("TPWEAVE_LOG", "").strip().upper()
    if not level or logger.handlers:
        return
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"TPWEAVE_LOG={level.lower()!r} is not a log level: debug, info, warning or error")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[tpweave %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
