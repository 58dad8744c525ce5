"""Catalog ``env`` values that are secrets: stored and sent to agents, never shown.

A model's engine may need a credential in its environment (``HF_TOKEN`` for a
gated repository, a licence key). The control plane must hand it to the
agent that starts the engine, but every read of the catalog (``GET
/admin/v1/models``, ``llmgw ctl models``, the console, ``apply`` answers)
used to show it to anyone holding the admin API's answers, a screenshot or a
terminal scrollback. A value is secret when its name is listed in the entry's
``secret_env``, or when the name says so (``*TOKEN*``, ``*SECRET*``,
``*PASSWORD*``, ``*API_KEY*``, ``*_KEY``): a forgotten ``secret_env`` should
not be what leaks a token.

Reads show :data:`REDACTED` in its place. Writing an entry back as it was read
(``ctl models show --json`` edited and applied) keeps the stored value: a
secret name whose value is :data:`REDACTED` means "unchanged".
"""

from __future__ import annotations

import re

from llmgw.errors import ValidationError
from llmgw.wire import ModelSpec

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|_KEY$|^KEY$", re.IGNORECASE)


def is_secret(spec: ModelSpec, name: str) -> bool:
    return name in spec.secret_env or bool(_SECRET_NAME.search(name))


def redacted(spec: ModelSpec) -> ModelSpec:
    """``spec`` as reads show it (the same object when nothing is secret)."""
    if not any(is_secret(spec, name) for name in spec.env):
        return spec
    env = {k: REDACTED if is_secret(spec, k) else v for k, v in spec.env.items()}
    return spec.model_copy(update={"env": env})


def check(spec: ModelSpec) -> None:
    """A ``secret_env`` name missing from ``env`` is a typo that would show the secret."""
    missing = [name for name in spec.secret_env if name not in spec.env]
    if missing:
        raise ValidationError(
            f"model {spec.name}: secret_env names {', '.join(missing)}, not in env",
            field="secret_env")


def restore(spec: ModelSpec, current: ModelSpec | None) -> ModelSpec:
    """``spec`` with each redacted secret value put back from ``current``.

    A redacted value with nothing to restore from is refused: storing the
    marker would start an engine with ``<redacted>`` as its token.
    """
    placeholders = [k for k, v in spec.env.items() if v == REDACTED and is_secret(spec, k)]
    if not placeholders:
        return spec
    env = dict(spec.env)
    for name in placeholders:
        if current is None or name not in current.env:
            raise ValidationError(
                f"model {spec.name}: env {name} is {REDACTED!r} but there is no stored value"
                " to keep; give the value itself", field="env")
        env[name] = current.env[name]
    return spec.model_copy(update={"env": env})
