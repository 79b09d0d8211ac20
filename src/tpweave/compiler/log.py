"""tpweave's logger. TPWEAVE_LOG=debug prints each graph before and after each pass."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("tpweave")
_level = os.environ.get("TPWEAVE_LOG", "").upper()
if _level and not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[tpweave %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, _level, logging.INFO))
