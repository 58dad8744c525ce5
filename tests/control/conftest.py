"""Fixtures for the control plane's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.control.planekit import Plane, served_plane


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    """A control plane on a fresh store with its first credentials, served on loopback."""
    async with served_plane(tmp_path) as served:
        yield served
