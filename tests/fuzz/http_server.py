"""llmgw's HTTP server (llmgw.http.connection) against request smuggling and malformed streams.

Each case is one connection carrying a few pipelined requests, some with a
framing trick (Content-Length with Transfer-Encoding, duplicate or signed
lengths, obs-fold, bare LF, bare CR, space before the colon, odd
transfer codings, bad chunk sizes, an oversized head), then a last request
that closes the connection. The server echoes what it read (method, path,
body digest, one header). The property: each request is either answered
exactly as it was meant (the one interpretation) or refused with 400 and
the connection closed; a request whose framing has two readings is never
answered 200 under the other reading, nothing after a refusal is
answered, and nothing is answered 5xx. (Requests pipelined before a refused
one, read with it, may go unanswered: the refusal closes the connection,
and a client resends what was not answered.)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from hypothesis import strategies as st
from tests.fuzz.runner import Failure, Hang, ServerError, Target
from tests.fuzz.servers import echo_app, exchange_raw, threaded_server

# How a request may be answered: "echo" exactly as meant, "400" refused,
# "echo-close": echoed, then the connection closed (RFC 9112 6.3: a request
# with both Transfer-Encoding and Content-Length may be read by its chunking
# but the connection must close after it).
ECHO, REFUSE, ECHO_CLOSE = "echo", "400", "echo-close"

# Feature -> what the server may do with a request carrying it.
FEATURES: dict[str | None, frozenset[str]] = {
    None: frozenset({ECHO}),
    "cl_te": frozenset({REFUSE, ECHO_CLOSE}),
    "dup_cl_differ": frozenset({REFUSE}),
    "dup_cl_same": frozenset({REFUSE, ECHO}),
    "signed_cl": frozenset({REFUSE}),
    "cl_list": frozenset({REFUSE, ECHO}),
    "te_not_last_chunked": frozenset({REFUSE}),
    "te_unknown": frozenset({REFUSE}),
    "te_case": frozenset({REFUSE, ECHO}),
    "obs_fold": frozenset({REFUSE, ECHO}),
    "bare_lf": frozenset({REFUSE, ECHO}),
    "bare_cr": frozenset({REFUSE}),
    "space_before_colon": frozenset({REFUSE}),
    "bad_chunk_size": frozenset({REFUSE}),
    "chunk_ext": frozenset({REFUSE, ECHO}),
    "oversized_head": frozenset({REFUSE}),
    "nul_in_header": frozenset({REFUSE}),
}


@dataclass(frozen=True)
class Spec:
    method: str
    path: str
    body: bytes
    chunked: bool
    probe: str
    feature: str | None
    variant: int


def _chunks(body: bytes, size_text: Any = None) -> bytes:
    out = b""
    for at in range(0, len(body), 7):
        piece = body[at:at + 7]
        size = size_text(len(piece)) if size_text else b"%x" % len(piece)
        out += size + b"\r\n" + piece + b"\r\n"
    return out + b"0\r\n\r\n"


def render(spec: Spec) -> bytes:
    """The request's bytes, with its feature (the body framed as ``chunked`` says)."""
    feature, v = spec.feature, spec.variant
    eol = b"\n" if feature == "bare_lf" else b"\r\n"
    lines = [f"{spec.method} {spec.path} HTTP/1.1".encode(), b"Host: fuzz"]
    probe = spec.probe.encode()
    if feature == "obs_fold":
        lines += [b"X-Probe: " + probe[:1], b" " + probe[1:]]
    elif feature == "bare_cr":
        lines.append(b"X-Probe: " + probe + b"\rX-Other: 1")
    elif feature == "nul_in_header":
        lines.append(b"X-Probe: " + probe + b"\x00")
    else:
        lines.append(b"X-Probe: " + probe)
    n = len(spec.body)
    body = _chunks(spec.body) if spec.chunked else spec.body
    if feature == "cl_te":
        lengths = [n, len(body), 0, n + 5, max(0, n - 1)]
        lines.append(b"Content-Length: %d" % lengths[v % len(lengths)])
        te = [b"Transfer-Encoding: chunked", b"Transfer-Encoding:chunked",
              b"Transfer-Encoding: chunked "][v % 3]
        order = [te, lines.pop()] if v % 2 else [lines.pop(), te]
        lines += order
        body = _chunks(spec.body)
    elif spec.chunked:
        if feature == "te_not_last_chunked":
            lines.append([b"Transfer-Encoding: chunked, identity",
                          b"Transfer-Encoding: chunked, gzip"][v % 2])
        elif feature == "te_unknown":
            lines.append([b"Transfer-Encoding: xchunked", b"Transfer-Encoding: chunked\x0b",
                          b"Transfer-Encoding: identity", b"Transfer-Encoding: \"chunked\""][v % 4])
        elif feature == "te_case":
            lines.append(b"Transfer-Encoding: ChUnKeD")
        elif feature == "space_before_colon":
            lines.append(b"Transfer-Encoding : chunked")
        else:
            lines.append(b"Transfer-Encoding: chunked")
        if feature == "bad_chunk_size":
            bad = [lambda k: b"0x%x" % k, lambda k: b"-%x" % k, lambda k: b"%x " % k + b"x",
                   lambda k: b"1" * 20, lambda k: b"+%x" % k, lambda k: b" %x" % k][v % 6]
            body = _chunks(spec.body or b"x", bad)
        elif feature == "chunk_ext":
            body = _chunks(spec.body, lambda k: b"%x;name=value" % k)
    elif n or spec.method != "GET" or feature in ("dup_cl_differ", "signed_cl", "cl_list",
                                                    "dup_cl_same", "space_before_colon"):
        if feature == "dup_cl_differ":
            lines += [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 1 + v % 5)]
        elif feature == "dup_cl_same":
            lines += [b"Content-Length: %d" % n, b"Content-Length: %d" % n]
        elif feature == "signed_cl":
            lines.append([b"Content-Length: +%d" % n, b"Content-Length: -%d" % (n or 1),
                          b"Content-Length: 0x%x" % n, b"Content-Length: %d.0" % n,
                          b"Content-Length: 1%s" % (b"0" * 25)][v % 5])
        elif feature == "cl_list":
            lines.append(b"Content-Length: %d, %d" % (n, n))
        elif feature == "space_before_colon":
            lines.append(b"Content-Length : %d" % n)
        else:
            lines.append(b"Content-Length: %d" % n)
    if feature == "oversized_head":
        lines.append(b"X-Big: " + b"b" * (70 * 1024 + v))
    return eol.join(lines) + eol + eol + body


_END = b"GET /end HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n"


def expected_echo(spec: Spec) -> dict[str, Any]:
    return {"m": spec.method, "p": spec.path, "n": len(spec.body),
            "h": hashlib.sha256(spec.body).hexdigest()[:16], "x": spec.probe}


class _Answers:
    """The answers in a byte stream, parsed as a client parses them."""

    def __init__(self) -> None:
        self.items: list[tuple[int, bytes]] = []
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.items.append((self.parser.get_status_code(), self._body))
        self._body = b""


def parse_answers(data: bytes) -> list[tuple[int, bytes]]:
    answers = _Answers()
    with contextlib.suppress(httptools.HttpParserError):
        answers.parser.feed_data(data)
    return answers.items


_names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~", min_size=1, max_size=12)
_feature = st.one_of(st.just(None), st.sampled_from(sorted(f for f in FEATURES if f)))


@st.composite
def _spec(draw: st.DrawFn) -> Spec:
    feature = draw(st.one_of(st.just(None), _feature))
    chunked = feature in ("te_not_last_chunked", "te_unknown", "te_case", "bad_chunk_size",
                          "chunk_ext") or (feature is None and draw(st.booleans()))
    method = draw(st.sampled_from(["GET", "POST", "PUT"] if feature is None else ["POST"]))
    body = draw(st.binary(max_size=40)) if method != "GET" else b""
    return Spec(method=method, path="/" + draw(_names), body=body, chunked=chunked,
                probe=draw(st.text("abcdefghij0123456789", min_size=2, max_size=10)),
                feature=feature, variant=draw(st.integers(0, 29)))


def strategy(_: Any) -> st.SearchStrategy[list[Spec]]:
    return st.lists(_spec(), min_size=1, max_size=4)


@contextlib.contextmanager
def _server() -> Iterator[tuple[str, int]]:
    with threaded_server(echo_app) as address:
        yield address


def check(address: tuple[str, int], specs: list[Spec]) -> None:
    stream = b"".join(map(render, specs)) + _END
    data, closed = exchange_raw(*address, stream, timeout_s=2.0)
    answers = parse_answers(data)
    for status, _ in answers:
        if status >= 500:
            raise ServerError(f"answered {status}: {data[:300]!r}")
    expected = [*specs, None]  # None: the closing request
    for at, (status, body) in enumerate(answers):
        if at >= len(expected):
            raise Failure(f"more answers ({len(answers)}) than requests sent ({len(expected)}):"
                          f" {data[:600]!r}")
        spec = expected[at]
        allowed = FEATURES[spec.feature] if spec is not None else frozenset({ECHO})
        if status == 400:
            # A refusal ends the connection: requests read with the refused
            # one (pipelined before it) may go unanswered, as if the client
            # had been cut off, but one of the requests from here on must be
            # one the server may refuse.
            if not any(later is not None and REFUSE in FEATURES[later.feature]
                       for later in expected[at:]):
                raise Failure(f"request {at} ({spec}) refused with 400: {data[:400]!r}")
            if at != len(answers) - 1 or not closed:
                raise Failure(f"answers after a 400, or the connection kept open: {data[:600]!r}")
            return
        if status != 200:
            raise Failure(f"request {at} answered {status}: {data[:300]!r}")
        if spec is None:
            if orjson.loads(body)["p"] != "/end":
                raise Failure(f"the closing request read as {body!r}")
            continue
        if not allowed & {ECHO, ECHO_CLOSE}:
            raise Failure(f"request {at} with {spec.feature} answered 200 ({body!r}),"
                          f" not refused")
        if orjson.loads(body) != expected_echo(spec):
            raise Failure(f"request {at} ({spec}) read as {body!r}, not as sent")
        if ECHO_CLOSE in allowed and ECHO not in allowed and at != len(answers) - 1:
            raise Failure(f"request {at} with {spec.feature} answered and the connection"
                          f" kept for more: {data[:600]!r}")
    if not closed:
        raise Hang(f"no answer to request {len(answers)} of {len(expected)} within 2 s"
                   f" (the server waits for bytes under another reading?): {data[:300]!r}")
    last = expected[len(answers) - 1] if answers else None
    if len(answers) < len(expected) and not (
            last is not None and ECHO_CLOSE in FEATURES[last.feature]):
        raise Failure(f"connection closed after {len(answers)} of {len(expected)} answers:"
                      f" {data[:400]!r}")


TARGET = Target("http_server_smuggling", lambda: _server(), strategy, check)


# -- byte-level mutations of valid streams: no 5xx, and the server stays up ----------

@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    specs = draw(st.lists(_spec().filter(lambda s: s.feature is None), min_size=1, max_size=3))
    data = bytearray(b"".join(map(render, specs)) + _END)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.integers(0, 3))
        if kind == 0:
            data[at] = draw(st.integers(0, 255))
        elif kind == 1:
            data[at:at] = draw(st.sampled_from(
                [b"\r", b"\n", b"\r\n", b" ", b"\t", b":", b"\x00", b"0", b"-", b";",
                 b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\n", b"\xff"]))
        elif kind == 2:
            del data[at:at + draw(st.integers(1, 8))]
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 40))]
    return bytes(data)


def check_mutated(address: tuple[str, int], data: bytes) -> None:
    received, _ = exchange_raw(*address, data, timeout_s=0.5, half_close=True)
    for status, _ in parse_answers(received):
        if status >= 500:
            raise ServerError(f"answered {status}: {received[:300]!r}")
    # Still serving: a plain request on a new connection is answered.
    again, _ = exchange_raw(*address, _END, timeout_s=2.0)
    if not again.startswith(b"HTTP/1.1 200"):
        raise Failure(f"the server stopped answering after this input: {again[:200]!r}")


MUTATED = Target("http_server_mutated", lambda: _server(), lambda _: _mutated(), check_mutated)
