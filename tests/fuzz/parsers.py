"""llmgw's parsers of outside input, each against generated and mutated input.

* OpenAI request validation (llmgw.gateway.checks.validation, front.parse): any
  JSON body is accepted or refused with a 4xx ApiError, nothing else.
* SSE relaying and usage parsing of engine answers (llmgw.gateway.routes.sse,
  passthrough): the relayed bytes and the usage found do not depend on how
  the stream was cut into reads, and a usage object is found in time
  linear in the answer.
* Agent reports (control.reportroute, control.telemetry): a body is
  validated or refused with a ValidationError, and the readings fast path
  never accepts a body the full validation refuses, nor reads other values.
* nvidia-smi XML and ``-L`` text (agent.discovery), seeded from real captures:
  a complete inventory or a DiscoveryError.
* Catalog YAML (control.catalog.parse_models): specs or a ValidationError.
* Join tokens (tls.split_join_token, control.jointokens): the secret and
  fingerprint or a ConfigError/AuthError, never another exception.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import orjson
from hypothesis import strategies as st
from pydantic import ValidationError as PydanticValidationError
from tests.fuzz.runner import Failure, Hang, Target, nothing

from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import parse_xml
from llmgw.control import telemetry
from llmgw.control.catalog import parse_models, validate_catalog
from llmgw.control.jointokens import JoinTokens
from llmgw.control.reportroute import _validated
from llmgw.errors import AuthError, ConfigError, DiscoveryError, LlmgwError, ValidationError
from llmgw.gateway import front
from llmgw.gateway.checks import validation
from llmgw.gateway.metering.usage import usage_in, usage_object
from llmgw.gateway.replies import ApiError
from llmgw.gateway.routes.sse import StreamRelay
from llmgw.tls import split_join_token

# -- JSON values, with the shapes OpenAI requests have ------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["user", "system", "assistant", "tool", "developer", "text", "image_url",
                     "json_object", "json_schema", "auto", "none", "required", "function",
                     "llama", "", "\u0000", "\ud7ff"]),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=8,
)
_FIELDS = ["model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens",
           "max_completion_tokens", "n", "temperature", "top_p", "stop", "logit_bias",
           "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "seed",
           "user", "query", "documents", "texts", "text_1", "text_2", "encoding_format",
           "dimensions", "include_usage", "content", "role", "echo", "suffix", "best_of"]
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
    optional={"content": st.one_of(st.text(max_size=10), _json), "name": _json,
              "tool_calls": _json, "tool_call_id": _json})
_payload = st.dictionaries(
    st.one_of(st.sampled_from(_FIELDS), st.text(max_size=8)),
    st.one_of(_json, st.lists(_message, max_size=3)), max_size=8)


def _body_strategy(_: Any) -> st.SearchStrategy[tuple[str, bytes]]:
    body = st.one_of(
        _payload.map(orjson.dumps),
        _json.map(orjson.dumps),
        st.binary(max_size=60),
        st.sampled_from([b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
                         b'{"model": "m", "max_tokens": 99999999999999999999999}',
                         b'{"a": 1e999}', b'{"model": 1}', b"[]", b"{}", b"null"]),
    )
    return st.tuples(st.sampled_from(sorted(validation.ENVELOPES)), body)


def _check_body(_: Any, case: tuple[str, bytes]) -> None:
    path, body = case
    try:
        payload = front.parse(body)
        validation.check_request(path, payload)
    except ApiError as exc:
        if not 400 <= exc.status < 500:
            raise Failure(f"refused with {exc.status}, not a 4xx: {exc}") from None


VALIDATION = Target("openai_request_validation", nothing, _body_strategy, _check_body)


# -- SSE relaying and usage ------------------------------------------------------------------

_usage = st.fixed_dictionaries({}, optional={
    "prompt_tokens": _json, "completion_tokens": _json, "total_tokens": _json,
    "input_tokens": _json, "output_tokens": _json,
    "prompt_tokens_details": st.one_of(_json, st.fixed_dictionaries({"cached_tokens": _json})),
})
_event = st.one_of(
    st.builds(lambda d: b"data: " + orjson.dumps(d),
              st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries({}, optional={
                  "delta": _json, "finish_reason": st.one_of(st.none(), st.text(max_size=6))}),
                  max_size=2)}, optional={"usage": st.one_of(_usage, _json)})),
    st.sampled_from([b"data: [DONE]", b"data:[DONE]", b": keep-alive", b"event: x\ndata: {}",
                     b'data: {"usage": {"prompt_tokens": 3}}', b'data: {"usage":{{}',
                     b'data: {"usage": {"a": "}"}}', b"data: ", b"\n"]),
    st.binary(max_size=30),
)


@st.composite
def _stream(draw: st.DrawFn) -> tuple[bytes, list[int], bool]:
    events = draw(st.lists(_event, max_size=8))
    sep = draw(st.sampled_from([b"\n\n", b"\r\n\r\n"]))
    data = b"".join(e + sep for e in events)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    return data, cuts, draw(st.booleans())


def _relay(data: bytes, cuts: list[int], strip: bool) -> tuple[bytes, Any, bool, bool]:
    relay = StreamRelay(strip)
    out, at = [], 0
    for cut in [*cuts, len(data)]:
        out.append(relay.feed(data[at:cut]))
        at = cut
    out.append(relay.flush())
    return b"".join(out), relay.usage, relay.finished, relay.done


def _events(stream: bytes) -> list[bytes]:
    """The SSE events a client reads from ``stream``: any line ending, blank events dropped."""
    lines = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    events, current = [], []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            events.append(b"\n".join(current))
            current = []
    if current:
        events.append(b"\n".join(current))
    return events


def _check_stream(_: Any, case: tuple[bytes, list[int], bool]) -> None:
    data, cuts, strip = case
    whole = _relay(data, [], strip)
    split = _relay(data, cuts, strip)
    # The same events (line endings and blank events are the relay's to
    # normalise), the same usage and the same verdict on the stream's end.
    if _events(whole[0]) != _events(split[0]) or whole[1:] != split[1:]:
        raise Failure(f"the relay's result depends on the reads: {whole!r} vs {split!r}")
    usage_in(data)


SSE = Target("sse_relay_and_usage", nothing, lambda _: _stream(), _check_stream)


@st.composite
def _answer_with_usage(draw: st.DrawFn) -> tuple[bytes, int]:
    nesting = draw(st.one_of(st.integers(0, 1000), st.integers(100_000, 300_000)))
    filler = draw(st.binary(max_size=50))
    shape = draw(st.sampled_from(["nested", "open", "flat"]))
    if shape == "nested":
        inner = b'{"x":' * nesting + b"1" + b"}" * nesting
    elif shape == "open":
        inner = b"{" * nesting
    else:
        inner = b'{"prompt_tokens": %d}' % nesting
    return b'{"data": [' + filler + b'], "usage": ' + inner + b"}", nesting


def _check_usage(_: Any, case: tuple[bytes, int]) -> None:
    data, _ = case
    started = time.perf_counter()
    usage_object(data)
    usage_in(data)
    took = time.perf_counter() - started
    # A usage object is looked for within 64 KiB of its start: a deep one
    # costs no more than that. Counting the braces afresh at each level
    # (quadratic) took minutes at 300,000 levels, one pass over them seconds.
    if took > 1.0:
        raise Hang(f"usage of a {len(data)}-byte answer took {took:.2f} s")


USAGE = Target("usage_parse_cost", nothing, lambda _: _answer_with_usage(), _check_usage)


# -- agent reports ----------------------------------------------------------------------


def _report_seed() -> bytes:
    from llmgw.sim import fleetgen
    from llmgw.wire import AgentReport

    node = fleetgen.gpu_node("fuzz-node", gpus=2, mig={1: ("1g.10gb", 2)})
    assert node.inventory is not None
    return AgentReport(node="fuzz-node", inventory=node.inventory).model_dump_json().encode()


@st.composite
def _report_body(draw: st.DrawFn) -> tuple[bytes, bytes]:
    seed = _SEED_REPORT[0]
    mode = draw(st.integers(0, 2))
    if mode == 0:  # change values in place: the same shape or another
        doc = orjson.loads(seed)
        devices = doc["inventory"]["devices"]
        for _ in range(draw(st.integers(1, 4))):
            if not devices:
                break
            device = devices[draw(st.integers(0, len(devices) - 1))]
            key = draw(st.sampled_from([*telemetry.TELEMETRY_FIELDS, *sorted(device)]))
            device[key] = draw(_json)
        body = orjson.dumps(doc)
    elif mode == 1:  # bytes edited
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 5))):
            at = draw(st.integers(0, len(data) - 1))
            data[at:at + draw(st.integers(0, 4))] = draw(st.binary(max_size=4))
        body = bytes(data)
    else:
        body = orjson.dumps(draw(_json))
    return seed, body


def _check_report(_: Any, case: tuple[bytes, bytes]) -> None:
    seed, body = case
    base = _validated(seed)
    shape = telemetry.shape_of(seed, base.inventory)
    fast = telemetry.read(body, shape) if shape is not None else None
    try:
        full = _validated(body)
    except (ValidationError, PydanticValidationError):
        if fast is not None:
            raise Failure("the readings path took a body the full validation refuses") from None
        return
    if fast is not None and fast != telemetry.readings_of(full.inventory):
        raise Failure(f"readings path read {fast},"
                      f" validation {telemetry.readings_of(full.inventory)}")


_SEED_REPORT: list[bytes] = []


def _report_setup() -> Any:
    if not _SEED_REPORT:
        _SEED_REPORT.append(_report_seed())
    return nothing()


REPORT = Target("agent_report", _report_setup, lambda _: _report_body(), _check_report)


# -- nvidia-smi --------------------------------------------------------------------------


def _smi_case(_: Any) -> st.SearchStrategy[tuple[str, bytes]]:
    from tests.agent.discovery.smi_helpers import list_text, xml_bytes, xml_fixtures

    names = xml_fixtures()

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, bytes]:
        name = draw(st.sampled_from(names))
        data = bytearray(xml_bytes(name))
        listing = list_text(name)
        for _ in range(draw(st.integers(0, 6))):
            at = draw(st.integers(0, len(data) - 1))
            data[at:at + draw(st.integers(0, 8))] = draw(st.one_of(
                st.binary(max_size=8),
                st.sampled_from([b"<gpu>", b"</gpu>", b"N/A", b"<mig_device>", b"&amp;",
                                 b"<![CDATA[x]]>", b"99999999999999999999", b"-1", b" MiB"])))
        if draw(st.booleans()):
            lines = listing.splitlines()
            if lines:
                at = draw(st.integers(0, len(lines) - 1))
                lines[at] = draw(st.one_of(st.text(max_size=60), st.just(lines[at][::-1]),
                                           st.just(lines[at].replace("UUID", "UUlD"))))
            listing = "\n".join(lines)
        return listing, bytes(data)

    return case()


def _check_smi(_: Any, case: tuple[str, bytes]) -> None:
    from tests.agent.discovery.test_discovery_props import pipeline

    listing, xml = case
    pipeline(listing, xml)
    with contextlib.suppress(DiscoveryError):
        parse_list(listing)
    with contextlib.suppress(DiscoveryError):
        parse_xml(xml)


SMI = Target("nvidia_smi_xml_and_list", nothing, _smi_case, _check_smi)


# -- catalog YAML ------------------------------------------------------------------------

_CATALOG_SEED = """\
models:
  - name: llama-3-8b
    source: hf://meta-llama/Meta-Llama-3-8B-Instruct
    engine: vllm
    min_replicas: 1
    max_replicas: 2
    gpu_count: 1
  - name: tiny
    source: hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF
    engine: llama_cpp
    engine_args: ["--ctx-size", "2048"]
"""


@st.composite
def _catalog_text(draw: st.DrawFn) -> str:
    mode = draw(st.integers(0, 2))
    if mode == 0:
        text = list(_CATALOG_SEED)
        for _ in range(draw(st.integers(1, 6))):
            at = draw(st.integers(0, len(text) - 1))
            text[at:at + draw(st.integers(0, 5))] = draw(st.sampled_from(
                [":", "-", " ", "\n", "[", "{", "&a", "*a", "!!python/object:os.system", "'",
                 "\"", "0", "-1", "1e400", "null", "~", "\t", "<<: *a", "\u2028", "yes"]))
        return "".join(text)
    if mode == 1:
        entry = st.dictionaries(st.sampled_from(
            ["name", "source", "engine", "min_replicas", "max_replicas", "gpu_count",
             "engine_args", "env", "max_output_tokens", "external", "aliases", "memory_gib",
             "api_key_env", "context_length", "x"]), _json, max_size=7)
        return orjson.dumps({"models": draw(st.lists(entry, max_size=3))}).decode()
    return draw(st.text(max_size=80))


def _check_catalog(_: Any, text: str) -> None:
    try:
        specs = parse_models(text)
        validate_catalog(specs)
    except (ValidationError, ConfigError):
        pass


CATALOG = Target("catalog_yaml", nothing, lambda _: _catalog_text(), _check_catalog)


# -- join tokens -------------------------------------------------------------------------

_TOKENS = JoinTokens()
_TOKEN_ID, _TOKEN_SECRET = None, ""


def _tokens_setup() -> Any:
    global _TOKEN_SECRET
    if not _TOKEN_SECRET:
        _, _TOKEN_SECRET = _TOKENS.create(ttl_s=3600.0, max_uses=5)
    return nothing()


@st.composite
def _join_case(draw: st.DrawFn) -> tuple[str, str]:
    fingerprint = "sha256:" + "ab" * 32
    token = draw(st.one_of(
        st.text(max_size=80),
        st.builds(lambda a, b: a + ".sha256:" + b, st.text(max_size=20),
                  st.text("0123456789abcdefABCDEF:x .", max_size=70)),
        st.just(_TOKEN_SECRET + "." + fingerprint),
        st.builds(lambda s: _TOKEN_SECRET[:s] + "\ud800", st.integers(0, 30)),
    ))
    document = draw(st.one_of(st.none(), st.just(_TOKENS.dump()), _json.map(
        lambda v: orjson.dumps(v).decode())))
    return token, document or ""


def _check_join(_: Any, case: tuple[str, str]) -> None:
    token, document = case
    try:
        secret, _fp = split_join_token(token)
    except ConfigError:
        return
    with contextlib.suppress(AuthError):
        _TOKENS.check(secret, time.time())
    # The stored document is the control plane's own: a bad one is a store
    # error at load, reported as such (not input from a caller).
    with contextlib.suppress(LlmgwError, ValueError, TypeError, orjson.JSONDecodeError):
        JoinTokens.parse(document or None, None)


JOIN = Target("join_tokens", _tokens_setup, lambda _: _join_case(), _check_join)

ALL = [VALIDATION, SSE, USAGE, REPORT, SMI, CATALOG, JOIN]
