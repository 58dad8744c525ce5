"""The engine tests' `llmgw up` (tests/engines/fleet.py), one per module."""

from tests.engines.fleet import fleet

__all__ = ["fleet"]
