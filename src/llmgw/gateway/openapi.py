"""The gateway's OpenAI API as an OpenAPI document, served at ``GET /v1/openapi.json``.

Built at import from what the gateway itself checks and routes, so it can
only say what the gateway does: each POST route's body lists the fields its
envelope checks (llmgw.gateway.checks.validation), the required ones as required,
and allows more (engines' own fields pass through untouched); the routes are
the gateway's route table (tests/gateway/test_openapi.py compares them);
answers are JSON, or an event stream where the route streams, and errors are
OpenAI's shape. Answers' bodies are the engines' own, so a success is
described as an object, not field by field. Public, as the admin API's
document: it says nothing about a fleet or its models.
"""

from __future__ import annotations

from typing import Any

import orjson

from llmgw.gateway.checks.validation import ENVELOPES
from llmgw.gateway.routes.table import ROUTES

OPENAPI_PATH = "/v1/openapi.json"
MODELS_PATH = "/v1/models"
MODEL_PATH = "/v1/models/{model}"

# Types for the fields every client sends, so that generated requests (and
# readers) get them right; every other field is the engine's to judge.
_TYPES: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "minLength": 1},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["system", "user", "assistant"]},
                       "content": {"type": "string"}}}},
    "prompt": {"type": "string"},
    "input": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 16},
}
_ERROR = {"$ref": "#/components/schemas/Error"}
_ERRORS = {
    "400": "A request the gateway refuses (the field is in error.param)",
    "401": "No API key, or a wrong one",
    "403": "The key may not use this model",
    "404": "No such model, or its engine does not serve the route",
    "413": "A body over the gateway's limit",
    "429": "The key's rate or token limit",
    "503": "No replica could take it now (Retry-After says when to retry)",
}


def _errors() -> dict[str, Any]:
    return {status: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
            for status, text in _ERRORS.items()}


def _body(path: str) -> dict[str, Any]:
    envelope = ENVELOPES[path]
    form = ROUTES[path].form
    fields = {name: ({"type": "string", "format": "binary"} if form and name == "file"
                     else dict(_TYPES.get(name, {}))) for name in envelope.fields}
    schema = {"type": "object", "required": list(envelope.required), "properties": fields}
    media = "multipart/form-data" if form else "application/json"
    return {"required": True, "content": {media: {"schema": schema}}}


def _post(path: str) -> dict[str, Any]:
    streams = ROUTES[path].streams
    answer: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        # Each event is the engine's chunk (JSON), ending with [DONE].
        answer["text/event-stream"] = {"schema": {}}
    return {"post": {
        "operationId": path.removeprefix("/v1/").replace("/", "_"),
        "requestBody": _body(path),
        "responses": {"200": {"description": "The engine's answer, as OpenAI's API gives it",
                              "content": answer}, **_errors()},
    }}


def _document() -> dict[str, Any]:
    listing = {"description": "Models the key may use", "content": {"application/json": {
        "schema": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        }}}}}
    model = {"description": "One model", "content": {"application/json": {
        "schema": {"type": "object", "required": ["id"]}}}}
    paths: dict[str, Any] = {path: _post(path) for path in sorted(ENVELOPES)}
    paths[MODELS_PATH] = {"get": {"operationId": "models", "responses": {
        "200": listing, **_errors()}}}
    paths[MODEL_PATH] = {"get": {
        "operationId": "model",
        "parameters": [{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "responses": {"200": model, **_errors()}}}
    paths[OPENAPI_PATH] = {"get": {"operationId": "openapi", "security": [], "responses": {
        "200": {"description": "This document",
                "content": {"application/json": {"schema": {"type": "object"}}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmgw gateway: OpenAI API", "version": "1"},
        "security": [{"apiKey": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "An API key (llmgw ctl keys create)"}},
            "schemas": {"Error": {
                "type": "object", "required": ["error"],
                "properties": {"error": {
                    "type": "object", "required": ["message", "type"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "integer", "null"]}}}}}},
        },
    }


DOCUMENT = _document()
DOCUMENT_BYTES = orjson.dumps(DOCUMENT)
