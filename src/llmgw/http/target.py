"""A request's target (``/v1/chat/completions``, ``/x?y=1``) as the ASGI scope's path and query."""

from __future__ import annotations

import urllib.parse

import httptools

# Request targets that are a plain path (no query, escape or fragment), as
# their str: httptools.parse_url was ~4 % of the gateway's CPU, for the same
# "/v1/chat/completions" every time. The server looks a target up here
# before it calls parse_target. Bounded: a client choosing paths must not
# grow it without end.
PLAIN_PATHS: dict[bytes, str] = {}
_PLAIN_PATHS_KEPT = 1024


def parse_target(url: bytes, root: str) -> tuple[str, bytes, bytes]:
    """(path, raw path, query) of a request target, as uvicorn makes them."""
    if (
        url[:1] == b"/"
        and url.isascii()
        and b"?" not in url
        and b"%" not in url
        and b"#" not in url
    ):
        raw_path, path, query = url, url.decode("ascii"), b""
        if len(PLAIN_PATHS) < _PLAIN_PATHS_KEPT:
            PLAIN_PATHS[url] = path
    else:
        parsed = httptools.parse_url(url)
        raw_path = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        query = parsed.query or b""
    if root:
        path = root + path
        raw_path = root.encode("ascii") + raw_path
    return path, raw_path, query
