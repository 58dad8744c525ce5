"""The one error body (wire.ErrorBody) and the one call to the control plane (llmgw.cpclient)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from llmgw.cpclient import ControlPlaneCaller, error_message
from llmgw.errors import AuthError, ControlPlaneUnavailable, ValidationError
from llmgw.wire import STANDBY_CODE, ErrorBody, ErrorDetail


def test_an_error_body_renders_the_shape_each_api_answers() -> None:
    # The control plane's: message, type and code, a missing code as null.
    assert orjson.loads(ErrorBody.of("no such node", "not_found_error").render()) == {
        "error": {"message": "no such node", "type": "not_found_error", "code": None}}
    # The gateway's (OpenAI's) adds param; fields nobody set stay out.
    openai = ErrorBody(error=ErrorDetail(message="m", type="invalid_request_error", param=None,
                                         code="bad"))
    assert orjson.loads(openai.render()) == {
        "error": {"message": "m", "type": "invalid_request_error", "code": "bad", "param": None}}


def test_an_error_body_is_read_whatever_else_it_carries() -> None:
    body = orjson.dumps({"error": {"message": "standby", "type": "standby_error",
                                   "code": STANDBY_CODE, "leader": None, "new": 1}, "x": 2})
    parsed = ErrorBody.parse(body)
    assert parsed is not None and parsed.from_standby and parsed.error.message == "standby"
    assert ErrorBody.message_in(body) == "standby"
    for other in (b"<html>bad gateway</html>", b"", b'{"error": "text"}',
                  b'{"error": {"code": 1}}', b"[1]"):
        assert ErrorBody.parse(other) is None, other
        assert ErrorBody.message_in(other) is None
    assert ErrorBody.message_in(b'{"error": {"message": ""}}') is None


def test_what_a_person_reads_of_an_error() -> None:
    assert error_message(ErrorBody.of("already registered", "x").render()) == "already registered"
    assert error_message(b"  Bad Gateway\n") == "Bad Gateway"
    assert error_message(b"") == "(no body)"
    assert len(error_message(b"x" * 5000)) == 500


@pytest.fixture
async def control_plane() -> AsyncIterator[str]:
    """Answers ``/STATUS`` with that status and an error body (``/html``: a proxy's page)."""

    async def handle(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "html":
            return web.Response(status=502, text="<html>bad gateway</html>")
        status = int(name)
        body = ErrorBody.of(f"said with {status}", "x").render() if status >= 300 else b"{}"
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_statuses_become_the_error_tree_once(control_plane: str) -> None:
    caller = ControlPlaneCaller(control_plane)
    async with aiohttp.ClientSession() as session:
        answer = await caller.call(session, "POST", "/200", credential="node token")
        assert (answer.url, answer.status, answer.body) == (control_plane, 200, b"{}")
        with pytest.raises(AuthError, match=r"refused the node token \(401\): said with 401"):
            await caller.call(session, "POST", "/401", credential="node token")
        with pytest.raises(AuthError, match=r"refused the join token \(403\)"):
            await caller.call(session, "POST", "/403", credential="join token")
        with pytest.raises(ValidationError, match="refused the fleet's models: said with 422"):
            await caller.call(session, "POST", "/422", credential="admin token",
                              refused="the fleet's models")
        with pytest.raises(ControlPlaneUnavailable,
                           match=rf"POST {control_plane}/500: HTTP 500: said with 500"):
            await caller.call(session, "POST", "/500", credential="node token")
        with pytest.raises(ControlPlaneUnavailable, match="HTTP 502: <html>bad gateway</html>"):
            await caller.call(session, "POST", "/html", credential="node token")
