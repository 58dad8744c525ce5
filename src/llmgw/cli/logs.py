"""Logging for the long-running commands (up, serve, agent, gateway, sim fleet): one format."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

# The --log-level flag of those commands.
LogLevel = Annotated[str, typer.Option(help="debug, info, warning, error.")]


def setup_logging(level: str, fallback: int = logging.INFO) -> None:
    """``level`` by name; ``fallback`` when the name is not a level."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), fallback),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
