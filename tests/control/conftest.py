"""Fixtures for the control plane's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.control.planekit import Api, Plane, opened_plane, served_plane
from tests.control.standby_kit import Pair, leader_and_standby

from llmgw.control.app import create_app
from llmgw.control.plane import ControlPlane


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    """A control plane on a fresh store, loaded; no credentials, not served."""
    async with opened_plane(tmp_path, credentials=False) as (control_plane, _):
        yield control_plane


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[Plane]:
    """A control plane on a fresh store with its first credentials, served on loopback."""
    async with served_plane(tmp_path) as served:
        yield served


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    """A control plane with its first credentials, called in-process through its app."""
    async with opened_plane(tmp_path) as (control_plane, creds):
        transport = httpx.ASGITransport(app=create_app(control_plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            yield client, control_plane, creds


@pytest.fixture
async def pair(pg_database_url: str) -> AsyncIterator[Pair]:
    """(leader, standby, credentials): two instances on one fresh PostgreSQL database."""
    async with leader_and_standby(pg_database_url) as started:
        yield started
