"""The benchmark scripts (bench/*.py) as modules, for tests of their own logic.

bench/ is not a package: each script is run by path, so a test loads it by
path too, under a name of its own in sys.modules (their dataclasses look
their module up there while they are defined).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(script: str) -> ModuleType:
    """``bench/<script>.py``, imported as the module ``bench_<script>``."""
    name = f"bench_{script}"
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
