"""The gateway's OpenAI API over HTTP: generated requests to every route, a simulated engine behind.

A real gateway (llmgw's own HTTP server) with one model routed to the
simulator, in a thread of its own. Bodies are JSON shaped like OpenAI
requests (and not), multipart forms and bytes, sent with the right key, a
wrong one and none, under assorted content types. An engine that is up
leaves the gateway no reason for a 5xx: none may come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import httpx
import orjson
from hypothesis import strategies as st
from tests.fuzz.parsers import _json, _message, _payload
from tests.fuzz.runner import ServerError, Target

_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
          "/v1/rerank", "/v1/score", "/v1/audio/transcriptions", "/v1/models", "/v1/nothing"]


class _Running:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self.key = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._main, daemon=True, name="fuzz-gateway")
        self.thread.start()
        if not self._ready.wait(30) or self._failed:
            raise RuntimeError(f"the fuzz gateway did not start: {self._failed}")
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._failed.append(exc)
            self._ready.set()

    async def _serve(self) -> None:
        from tests.gateway.conftest import SECRET, fast_settings, make_config, running_gateway
        from tests.gateway.sims import LLAMA_DIALECT, running_sim

        from llmgw import wire
        from llmgw.gateway.link import MemoryLink

        self._stop = asyncio.Event()
        link = MemoryLink(poll_timeout_s=1.0)
        async with running_sim() as engine:
            endpoint = wire.Endpoint(replica_id="sim-1", url=engine.url, dialect=LLAMA_DIALECT)
            link.publish(make_config(1, [wire.ModelRoute(name="m", served_name="sim",
                                                         endpoints=[endpoint])]))
            async with running_gateway(link, fast_settings()) as (_, url):
                self.url, self.key = url, SECRET
                self._ready.set()
                await self._stop.wait()

    def close(self) -> None:
        self.client.close()
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(20)


def _setup() -> contextlib.closing[_Running]:
    return contextlib.closing(_Running())


@st.composite
def _request(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    path = draw(st.sampled_from(_PATHS))
    method = draw(st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE"]))
    payload = draw(st.one_of(
        _payload,
        st.fixed_dictionaries({"model": st.sampled_from(["m", "m", "nope", ""])}, optional={
            "messages": st.lists(_message, max_size=3), "prompt": _json, "input": _json,
            "stream": st.one_of(st.booleans(), _json), "max_tokens": _json,
            "stream_options": _json, "n": _json, "stop": _json, "query": _json,
            "documents": _json, "text_1": _json, "text_2": _json}),
    ))
    if draw(st.booleans()) and isinstance(payload, dict):
        payload.setdefault("model", "m")
        # Keep answers short: the engine is real (simulated), and so is its time.
        if "max_tokens" not in payload:
            payload["max_tokens"] = 4
    body = draw(st.one_of(st.just(orjson.dumps(payload)), st.binary(max_size=60)))
    headers = {"Content-Type": draw(st.sampled_from(
        ["application/json", "text/plain", "multipart/form-data; boundary=x",
         "multipart/form-data", "application/json; charset=latin-1", ""]))}
    who = draw(st.sampled_from(["key", "key", "key", "wrong", "none"]))
    if who != "none":
        headers["Authorization"] = "Bearer " + ("KEY" if who == "key" else "sk-wrong")
    return method, path, headers, body


def _check(running: _Running, case: tuple[str, str, dict[str, str], bytes]) -> None:
    method, path, headers, body = case
    headers = {k: v.replace("KEY", running.key) for k, v in headers.items() if v}
    answer = running.client.request(method, path, headers=headers, content=body)
    if answer.status_code >= 500:
        raise ServerError(f"{method} {path} answered {answer.status_code}: {answer.text[:300]}")


TARGET = Target("gateway_openai_api", _setup, lambda _: _request(), _check)


# -- schemathesis over the gateway's OpenAPI document -------------------------------------


def _operations(_: Any) -> st.SearchStrategy[Any]:
    import schemathesis

    from llmgw.gateway.openapi import DOCUMENT

    schema = schemathesis.openapi.from_dict(DOCUMENT)
    return st.one_of([result.ok().as_strategy() for result in schema.get_all_operations()])


def _check_documented(running: _Running, case: Any) -> None:
    from tests.fuzz.control import validated

    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "m"  # to the engine, where a request goes furthest
    validated(case, running.url, {"Authorization": f"Bearer {running.key}"}, statuses=True)


SCHEMA = Target("gateway_api_schemathesis", _setup, _operations, _check_documented)
