"""The catalog's cap on generated tokens, applied to each request before it is sent.

Why: a request without any limit lets an engine generate until its context
is full. On llama_cpp.server that is minutes of a CPU slot and a gigabyte of
memory for one forgotten ``max_tokens``; and a non-streamed request keeps
generating there even after its client has gone (the server notices a
disconnect only between streamed chunks). A model's ``max_output_tokens``
bounds every answer.

The rule:
* no limit from the client (neither ``max_tokens`` nor
  ``max_completion_tokens``, or both null): the cap becomes ``max_tokens``;
* a limit above the cap is lowered to the cap, not refused. OpenAI answers
  400 to a limit above the model's maximum, but many clients send a large
  habitual value (4096, the context size) that they never expect to reach;
  lowered, they still work, and an answer that hits the cap ends with
  ``finish_reason: "length"`` as any answer that hits its limit does;
* a limit at or below the cap is left as the client sent it.

When a cap applies, the upstream body carries the resulting limit in
``max_tokens`` (and in ``max_completion_tokens`` when the client used it):
every engine reads at least one of the two, and llama.cpp reads only
``max_tokens``, so the cap holds whichever field the engine honours.
"""

from __future__ import annotations

from typing import Any


def cap_output_tokens(payload: dict[str, Any], cap: int | None) -> bool:
    """Bring the request's output limit within ``cap``; True when ``payload`` changed.

    ``payload`` has passed :mod:`llmgw.gateway.checks.validation`: both limits are
    integers or null.
    """
    if cap is None:
        return False
    asked = payload.get("max_tokens")
    newer = payload.get("max_completion_tokens")
    limit = cap
    if asked is not None and asked < limit:
        limit = asked
    if newer is not None and newer < limit:
        limit = newer
    changed = False
    if asked != limit:
        payload["max_tokens"] = limit
        changed = True
    if newer is not None and newer != limit:
        payload["max_completion_tokens"] = limit
        changed = True
    return changed
