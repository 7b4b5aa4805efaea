"""What both server processes do alike at start: logging to stderr in one format."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    """Logs go to stderr (stdout carries only the `listening on` banner)."""
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)
