"""The console's files as the control plane serves them (no browser needed)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.control.planekit import opened_plane
from tests.servers import serve_asgi

from llmgw.console.server import CONTENT_SECURITY_POLICY, STATIC_DIR
from llmgw.control.app import create_app


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with opened_plane(tmp_path) as (cp, _), serve_asgi(create_app(cp)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        yield http


async def test_console_is_served_with_its_headers(client: httpx.AsyncClient) -> None:
    bare = await client.get("/console")
    assert bare.status_code == 307
    assert bare.headers["location"] == "/console/"
    index = await client.get("/console/")
    assert index.status_code == 200
    assert index.headers["content-type"].startswith("text/html")
    assert index.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY
    main = await client.get("/console/static/js/main.js")
    assert main.status_code == 200
    # Module scripts are refused by browsers unless served as JavaScript.
    assert "javascript" in main.headers["content-type"]
    assert main.headers["x-content-type-options"] == "nosniff"
    css = await client.get("/console/static/console.css")
    assert css.headers["content-type"].startswith("text/css")


async def test_no_file_outside_the_console_is_reachable(client: httpx.AsyncClient) -> None:
    for path in ("/console/static/../server.py", "/console/static/%2e%2e/server.py",
                 "/console/static/nope.js"):
        answer = await client.get(path)
        assert answer.status_code == 404, path


async def test_every_reference_in_the_console_is_local(client: httpx.AsyncClient) -> None:
    """Air-gapped: no file names a URL of another origin (a CDN, a font host)."""
    files = sorted(p for p in STATIC_DIR.rglob("*") if p.is_file())
    assert {p.suffix for p in files} <= {".html", ".js", ".css", ".svg"}
    for path in files:
        text = path.read_text()
        # The SVG namespace is a name, never fetched; anything else is.
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)
        for imported in re.findall(r"from \"([^\"]+)\"", text):
            assert imported.startswith("./") or imported.startswith("../"), (path, imported)
            assert (path.parent / imported).resolve().is_file(), (path, imported)
        # Served, with the same bytes.
        rel = path.relative_to(STATIC_DIR).as_posix()
        served = await client.get(f"/console/static/{rel}")
        assert served.status_code == 200, rel
        assert served.content == path.read_bytes()
