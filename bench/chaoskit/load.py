"""Steady load through the gateway with the official ``openai`` client, every request recorded.

Closed-loop workers (each sends, waits for the whole answer, pauses, sends
again), so the load stays steady however slow the fleet gets during a fault
instead of piling up. The client never retries by itself (``max_retries=0``):
whatever the gateway lets through to a client is counted as it happened.

A request is judged by what a client can tell: a non-streamed answer with a
message, or a stream whose last chunk carried a ``finish_reason``. An error
is kept with its HTTP status and OpenAI error code; both say whether the
request had reached a replica (``upstream_unavailable``, ``model_not_ready``:
it had not).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

import openai
from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk

# Error codes that say the gateway never had a replica take the request.
UNSTARTED_CODES = frozenset({
    "upstream_unavailable", "model_not_ready", "not_ready", "model_parked",
    "rate_limit_exceeded",
})


@dataclass(frozen=True)
class Worker:
    """One closed loop of requests to one model."""

    model: str
    stream: bool = False
    max_tokens: int = 8
    pause_s: float = 0.05


@dataclass
class Record:
    model: str
    stream: bool
    sent: float  # time.monotonic()
    done: float = 0.0
    ok: bool = False
    status: int | None = None
    code: str | None = None
    error: str | None = None
    # Streams: chunks received before the end (0: it failed before starting).
    chunks: int = 0
    # The gateway answered (usage is counted for it), as opposed to a
    # connection that never reached it or a client that gave up.
    answered: bool = False


@dataclass
class Load:
    base_url: str
    api_key: str
    workers: list[Worker]
    timeout_s: float = 120.0
    # A slow reader's pause after each chunk of a stream.
    read_pause_s: float = 0.0
    records: list[Record] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _client: openai.AsyncOpenAI | None = None
    _serial: int = 0

    def start(self) -> None:
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0,
            timeout=self.timeout_s,
        )
        self._tasks = [asyncio.create_task(self._run(w)) for w in self.workers]

    async def stop(self, drain_s: float = 60.0) -> None:
        """Let requests in flight finish (those still out after ``drain_s`` count as failed)."""
        self._stop.set()
        _, pending = await asyncio.wait(self._tasks, timeout=drain_s) if self._tasks else ((), ())
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def add(self, worker: Worker) -> None:
        """One more worker, from now on."""
        self.workers.append(worker)
        self._tasks.append(asyncio.create_task(self._run(worker)))

    def answered_since(self, since: float) -> int:
        return sum(1 for r in self.records if r.ok and r.sent >= since)

    async def wait_answers(self, count: int, since: float, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.answered_since(since) >= count:
                return True
            await asyncio.sleep(0.1)
        return False

    async def _run(self, worker: Worker) -> None:
        while not self._stop.is_set():
            self._serial += 1
            record = Record(worker.model, worker.stream, time.monotonic())
            self.records.append(record)
            try:
                await self._one(worker, record, self._serial)
            except asyncio.CancelledError:
                record.error = "no answer before the load stopped"
                record.done = time.monotonic()
                raise
            record.done = time.monotonic()
            await asyncio.sleep(worker.pause_s)

    async def _one(self, worker: Worker, record: Record, serial: int) -> None:
        assert self._client is not None
        messages = [{"role": "user", "content": f"Chaos request {serial}: say something."}]
        try:
            if not worker.stream:
                answer = await self._client.chat.completions.create(
                    model=worker.model, messages=messages,  # type: ignore[arg-type]
                    max_tokens=worker.max_tokens,
                )
                record.answered = True
                record.ok = bool(answer.choices) and answer.choices[0].message is not None
                if not record.ok:
                    record.error = "an answer without a message"
                return
            stream = cast(AsyncStream[ChatCompletionChunk],
                          await self._client.chat.completions.create(
                              model=worker.model, messages=messages,  # type: ignore[arg-type]
                              max_tokens=worker.max_tokens, stream=True))
            record.answered = True
            finished = False
            async for chunk in stream:
                record.chunks += 1
                if self.read_pause_s:
                    await asyncio.sleep(self.read_pause_s)
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finished = True
            record.ok = finished
            if not finished:
                record.error = "the stream ended without a finish_reason"
        except openai.APIStatusError as exc:
            record.answered = True
            record.status = exc.status_code
            record.code = _code(exc)
            record.error = f"{exc.status_code} {record.code}: {_message(exc)}"
        except openai.APIConnectionError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        except openai.APIError as exc:  # an error event inside a stream
            record.answered = True
            record.code = _code(exc)
            record.error = f"stream error {record.code}: {_message(exc)}"


def _code(exc: openai.APIError) -> str | None:
    code = getattr(exc, "code", None)
    if code is None and isinstance(exc.body, dict):
        inner = exc.body.get("error", exc.body)
        code = inner.get("code") if isinstance(inner, dict) else None
    return str(code) if code is not None else None


def _message(exc: openai.APIError) -> str:
    return str(exc.message).splitlines()[0][:200]
