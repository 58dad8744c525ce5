"""External models through the gateway: the upstream's key, name and path, health, TLS.

The upstreams are real HTTP servers on loopback: a "hosted API" that serves
OpenAI's routes under a path prefix, refuses any request without its key and
answers with a dated variant of the model's name (as hosted APIs do), and the
fake engines of the other gateway tests as plain external URLs.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from tests.gateway.conftest import async_client, fast_settings, make_config, running_gateway
from tests.gateway.fake_upstream import FakeUpstream
from tests.waiting import eventually

from llmgw import wire
from llmgw.control import external
from llmgw.control.services.gateways import served_name
from llmgw.gateway.link import MemoryLink
from llmgw.servertls import ensure_server_tls

# Characters an engine key may not hold but a hosted API's key may.
KEY = "hosted-Key.with/odd+chars=0123456789"
UPSTREAM = "meta/llama-x"


class HostedApi:
    """OpenAI's routes under /openai/v1, for callers bearing KEY only."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        @web.middleware
        async def check_key(request: web.Request, handler: Any) -> web.StreamResponse:
            self.auth.append(request.headers.get("Authorization"))
            if request.headers.get("Authorization") != f"Bearer {KEY}":
                error = {"message": "bad key", "type": "invalid_request_error", "code": "auth"}
                return web.json_response({"error": error}, status=401)
            return await handler(request)  # type: ignore[no-any-return]

        app = web.Application(middlewares=[check_key])
        app.router.add_get("/openai/v1/models", self._models)
        app.router.add_post("/openai/v1/chat/completions", self._chat)
        app.router.add_post("/openai/v1/embeddings", self._embeddings)
        return app

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=tls)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/openai"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": UPSTREAM}]})

    @staticmethod
    def _dated(body: dict[str, Any]) -> str:
        return f"{body['model']}-2024-08-06"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        usage = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
        if not body.get("stream"):
            return web.json_response({
                "id": "c1", "object": "chat.completion", "created": 1, "model": self._dated(body),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hi there"}}],
                "usage": usage,
            })  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                "model": self._dated(body)}  # fmt: skip
        for delta, finish in (({"role": "assistant", "content": "hi"}, None),
                              ({"content": " there"}, None), ({}, "stop")):  # fmt: skip
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {**head, "choices": [], "usage": usage}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        return web.json_response({
            "object": "list", "model": self._dated(body),
            "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
        })  # fmt: skip


@pytest.fixture
async def hosted() -> AsyncIterator[HostedApi]:
    api = HostedApi()
    yield api
    await api.stop()


def external_route(
    name: str, urls: list[str], **fields: Any
) -> wire.ModelRoute:
    """The route the control plane makes of an external catalog entry (control.external)."""
    routing = fields.pop("routing", "prefix")
    spec = wire.ModelSpec.model_validate(
        {"name": name, "routing": routing, "external": {"urls": urls, **fields}}
    )
    return wire.ModelRoute(
        name=name, routing=routing, served_name=served_name(spec),
        endpoints=external.endpoints(spec),
    )  # fmt: skip


def _health(link: MemoryLink, url: str) -> tuple[bool | None, str | None]:
    """The latest health the gateway reported for the URL ending in ``url``."""
    for report in reversed(link.loads):
        for load in report.replicas:
            if load.replica_id.endswith(url):
                return load.up, load.reason
    return None, None


FAST = {"health_interval_s": 0.2, "health_timeout_s": 2.0, "health_failures": 2}


async def test_a_hosted_api_gets_its_key_its_name_and_its_path(
    hosted: HostedApi, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("LLMGW_EXTERNAL_HOSTED", KEY)
    base = await hosted.start()
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [external_route(
        "team", [base], model=UPSTREAM, api_key_env="LLMGW_EXTERNAL_HOSTED"
    )]))  # fmt: skip
    async with running_gateway(link, fast_settings(**FAST)) as (_, url):
        client = async_client(url)
        reply = await client.chat.completions.create(
            model="team", messages=[{"role": "user", "content": "hello"}]
        )
        # The upstream got its own name for the model; the client gets the catalog's.
        assert hosted.bodies[-1]["model"] == UPSTREAM
        assert reply.model == "team" and reply.choices[0].message.content == "hi there"
        assert reply.usage is not None and reply.usage.total_tokens == 13

        stream = await client.chat.completions.create(
            model="team", messages=[{"role": "user", "content": "hello"}], stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert {c.model for c in chunks} == {"team"}
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 11
        # A client that asks for no usage gets none, but the gateway asked the
        # upstream for it (a faithful OpenAI dialect) and meters it.
        stream = await client.chat.completions.create(
            model="team", messages=[{"role": "user", "content": "hello"}], stream=True
        )
        plain = [chunk async for chunk in stream]
        assert all(c.usage is None for c in plain) and plain[-1].choices
        assert hosted.bodies[-1]["stream_options"] == {"include_usage": True}

        embedded = await client.embeddings.create(model="team", input="x")
        assert embedded.model == "team"

        # Every request and probe carried the key, from the gateway's environment.
        assert hosted.auth and set(hosted.auth) == {f"Bearer {KEY}"}
        await eventually(lambda: _health(link, base)[0] is True)
        await eventually(lambda: sum(r.prompt_tokens for r in link.usage) == 3 * 11 + 3)
        assert sum(r.completion_tokens for r in link.usage) == 3 * 2
    assert KEY not in caplog.text


async def test_a_missing_key_takes_the_url_out_and_says_why(
    hosted: HostedApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_EXTERNAL_UNSET", raising=False)
    base = await hosted.start()
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [
        external_route("team", [base], api_key_env="LLMGW_EXTERNAL_UNSET")]))
    async with running_gateway(link, fast_settings(**FAST)) as (_, url):
        await eventually(lambda: _health(link, base)[0] is False)
        reason = _health(link, base)[1] or ""
        assert "LLMGW_EXTERNAL_UNSET" in reason and "not set" in reason
        with pytest.raises(openai.APIStatusError) as refused:
            await async_client(url).chat.completions.create(
                model="team", messages=[{"role": "user", "content": "hello"}]
            )
        assert refused.value.status_code == 503


async def test_a_key_env_outside_the_prefix_is_sent_only_where_the_operator_allows(
    hosted: HostedApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The catalog (the admin token) names any variable of the gateway's
    # environment; its value would go as a bearer token to the catalog's URL.
    monkeypatch.setenv("PGPASSWORD", "db-secret")
    base = await hosted.start()
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, [external_route("team", [base], api_key_env="PGPASSWORD")]))
    async with running_gateway(link, fast_settings(**FAST)) as (_, url):
        await eventually(lambda: _health(link, base)[0] is False)
        reason = _health(link, base)[1] or ""
        assert "--allow-key-env PGPASSWORD" in reason and "LLMGW_EXTERNAL_" in reason
        with pytest.raises(openai.APIStatusError):
            await async_client(url).chat.completions.create(
                model="team", messages=[{"role": "user", "content": "hello"}])
    assert all("db-secret" not in (auth or "") for auth in hosted.auth)
    allowed = fast_settings(**FAST, key_env_allowed=frozenset({"PGPASSWORD"}))
    async with running_gateway(link, allowed) as (_, url):
        await eventually(lambda: "Bearer db-secret" in hosted.auth)


async def test_a_dead_url_leaves_routing_and_comes_back() -> None:
    up = await FakeUpstream("a").start()
    dying = await FakeUpstream("b").start()
    try:
        link = MemoryLink(poll_timeout_s=1.0)
        link.publish(make_config(1, [external_route(
            "team", [up.url, dying.url], routing="round-robin"
        )]))  # fmt: skip
        async with running_gateway(link, fast_settings(**FAST)) as (gateway, url):
            client = async_client(url)

            async def answered_by() -> set[str]:
                names = set()
                for _ in range(8):
                    reply = await client.chat.completions.create(
                        model="team", messages=[{"role": "user", "content": "hi"}]
                    )
                    names.add(str(reply.system_fingerprint))
                return names

            await eventually(lambda: _health(link, dying.url)[0] is True)
            assert await answered_by() == {"a", "b"}

            await dying.stop()
            await eventually(lambda: _health(link, dying.url)[0] is False)
            assert "unreachable" in (_health(link, dying.url)[1] or "")
            retried = gateway.metrics.render().count(b"retr")
            assert await answered_by() == {"a"}
            # Out of routing: not merely retried away from on every request.
            assert gateway.metrics.render().count(b"retr") == retried

            back = await FakeUpstream("b", port=dying.port).start()
            try:
                await eventually(lambda: _health(link, dying.url)[0] is True)
                assert await answered_by() == {"a", "b"}
            finally:
                await back.stop()
    finally:
        await up.stop()
        await dying.stop()


async def test_https_upstreams_are_verified_against_the_trust_store(
    hosted: HostedApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tls = ensure_server_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    base = await hosted.start(context)
    assert base.startswith("https://")
    monkeypatch.setenv("LLMGW_EXTERNAL_HOSTED", KEY)
    routes = [external_route("team", [base], model=UPSTREAM, api_key_env="LLMGW_EXTERNAL_HOSTED")]

    # Not trusted (the system's store knows no such CA): never sent, and said why.
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, routes))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nothing.pem"))
    async with running_gateway(link, fast_settings(**FAST)):
        await eventually(lambda: _health(link, base)[0] is False)
        assert "certificate" in (_health(link, base)[1] or "").lower()
    assert not hosted.bodies

    monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca_file))
    link = MemoryLink(poll_timeout_s=1.0)
    link.publish(make_config(1, routes))
    async with running_gateway(link, fast_settings(**FAST)) as (_, url):
        reply = await async_client(url).chat.completions.create(
            model="team", messages=[{"role": "user", "content": "hello"}]
        )
        assert reply.model == "team" and hosted.bodies[-1]["model"] == UPSTREAM
        await eventually(lambda: _health(link, base)[0] is True)
