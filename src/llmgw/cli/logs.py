"""Logging for the long-running commands (up, serve, agent, gateway, sim fleet): one format."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, fallback: int = logging.INFO) -> None:
    """``level`` by name; ``fallback`` when the name is not a level."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), fallback),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
