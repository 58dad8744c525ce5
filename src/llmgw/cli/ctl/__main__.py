"""``python -m llmgw.cli.ctl``: the ctl app alone, without the rest of the CLI."""

from __future__ import annotations

import os

from llmgw.cli.ctl import app

if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("COLUMNS", "160")
    app()
