"""The gateway's multipart form reader: fields found in place, the body sent on intact."""

from __future__ import annotations

import httpx
import pytest

from llmgw.gateway.metering.usage import usage_in
from llmgw.gateway.multipart import Upload, boundary_of, read_form, with_model
from llmgw.gateway.replies import ApiError
from llmgw.gateway.routes.passthrough import EventRelay


def _encoded(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, bytes]:
    """A form as httpx (what the openai client uses) encodes it: (content type, body)."""
    request = httpx.Request("POST", "http://x/", data=fields, files=files)
    return request.headers["content-type"].encode(), request.read()


def test_fields_are_read_and_the_file_is_only_described() -> None:
    audio = b"RIFF" + bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n"
    kind, body = _encoded({"model": "whisper", "language": "en"}, {"file": ("a b.wav", audio)})
    form = read_form(body, boundary_of(kind))
    assert form["model"] == "whisper" and form["language"] == "en"
    upload = form["file"]
    assert isinstance(upload, Upload) and upload.filename == "a b.wav"
    assert upload.size == len(audio)
    renamed = with_model(body, form, "openai/whisper-large-v3")
    again = read_form(renamed, boundary_of(kind))
    assert again["model"] == "openai/whisper-large-v3" and again["language"] == "en"
    assert renamed.replace(b"openai/whisper-large-v3", b"whisper", 1) == body


def test_array_fields_collect_and_rfc5987_file_names_count_as_files() -> None:
    body = (b"--b\r\nContent-Disposition: form-data; name=\"timestamp_granularities[]\"\r\n\r\n"
            b"word\r\n--b\r\nContent-Disposition: form-data; name=\"timestamp_granularities[]\""
            b"\r\n\r\nsegment\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; "
            b"filename*=UTF-8''%C3%A9.wav\r\n\r\n\xff\xfe\r\n--b--\r\n")  # fmt: skip
    form = read_form(body, b"b")
    assert form["timestamp_granularities[]"] == ["word", "segment"]
    assert isinstance(form["file"], Upload) and form["file"].size == 2


@pytest.mark.parametrize(
    ("content_type", "body", "words"),
    [
        (b"application/json", b"{}", "multipart/form-data"),
        (b"multipart/form-data", b"", "no boundary"),
        (b'multipart/form-data; boundary="b\r\nX: y"', b"", "no boundary"),
        (b"multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; "
         b"name=\"model\"\r\n\r\nm\r\n--b", "truncated"),
        (b"multipart/form-data; boundary=b", b"--b\r\nX: y\r\n\r\nm\r\n--b--", "Disposition"),
        (b"multipart/form-data; boundary=b", b"nothing", "boundary"),
        (b"multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; "
         b"name=\"model\"\r\n\r\n\xff\r\n--b--", "UTF-8"),
        # A control character in a part's head: engines refuse the whole form (schemathesis).
        (b"multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; "
         b"name=\"a\x02b\"\r\n\r\nx\r\n--b--", "control character"),
        (b"multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; "
         b"name=\"a\nX: y\"\r\n\r\nx\r\n--b--", "control character"),
    ],
)  # fmt: skip
def test_broken_forms_are_400(content_type: bytes, body: bytes, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        read_form(body, boundary_of(content_type))
    assert refused.value.status == 400 and words in refused.value.message


def test_usage_in_every_shape() -> None:
    responses = b'{"output":[],"usage":{"input_tokens":7,"input_tokens_details":' \
        b'{"cached_tokens":4},"output_tokens":3,"total_tokens":10}}'
    usage = usage_in(responses)
    assert usage is not None and (usage.prompt, usage.completion, usage.cached) == (7, 3, 4)
    rerank = usage_in(b'{"results":[],"usage":{"total_tokens":12}}')
    assert rerank is not None and (rerank.prompt, rerank.completion) == (12, 0)
    audio = usage_in(b'{"text":"hi","usage":{"type":"duration","seconds":3}}')
    assert audio is not None and (audio.prompt, audio.completion) == (0, 0)
    assert usage_in(b'{"text":"hi"}') is None


def test_event_relay_ends_only_on_a_terminal_event() -> None:
    ends = (b'"type":"response.completed"',)
    relay = EventRelay(ends, (b'"type":"response.failed"',))
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",' \
        b'"delta":"\\"type\\":\\"response.completed\\""}\n\n'
    assert relay.feed(delta[:20]) == b"" and relay.feed(delta[20:]) == delta
    assert not relay.ended  # the words in the text are not the event
    done = b'event: response.completed\ndata: {"type":"response.completed","response":' \
        b'{"usage":{"input_tokens":2,"output_tokens":1}}}\n\n'
    assert relay.feed(done) == done and relay.ended and not relay.failed
    assert relay.usage is not None and relay.usage.completion == 1
