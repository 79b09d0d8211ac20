"""tpweave's logger ("tpweave"). Importing it installs no handler: an application configures logging
its own way, or calls `configure_from_env()` (the CLI, `launch`'s ranks and `tpweave.compile` do), which
reads TPWEAVE_LOG (debug, info, warning: debug prints each graph before and after each pass)."""

from __future__ import annotations

import logging
import os
import sys
import time

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


# Stage messages of long operations (compiling a graph, capturing CUDA graphs, generating): silent in a
# library, shown by the command line (`enable_progress`) on rank 0.
progress_logger = logging.getLogger("tpweave.progress")


def progress(msg: str, *args: object) -> None:
    """Report a stage of a long operation (printed only where `enable_progress` was called)."""
    progress_logger.info(msg, *args)


def progress_bar(total: int | None = None, items=None, *, desc: str):
    """A tqdm bar on a terminal; elsewhere (a log file, a pipe) none: a bar's carriage returns would run into the
    lines printed after it. Iterate it (`items`) or update() it (`total`)."""
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, leave=False, disable=not sys.stderr.isatty())


def enable_progress() -> None:
    """Print progress messages to stderr with the seconds since this call."""
    if progress_logger.handlers:
        return
    start = time.monotonic()

    class _Elapsed(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"[tpweave {time.monotonic() - start:6.1f}s] {record.getMessage()}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Elapsed())
    progress_logger.addHandler(handler)
    progress_logger.setLevel(logging.INFO)
    progress_logger.propagate = False
