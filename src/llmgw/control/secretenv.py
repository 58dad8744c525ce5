"""Catalog ``env`` values that are secrets: stored and sent to agents, never shown.

A model's engine may need a credential in its environment (``HF_TOKEN`` for a
gated repository, a licence key). The control plane must hand it to the
agent that starts the engine, but every read of the catalog (``GET
/admin/v1/models``, ``llmgw ctl models``, the console, ``apply`` answers)
would show it to anyone holding the admin API's answers, a screenshot or a
terminal scrollback. A value is secret when its name is listed in the entry's
``secret_env``, when the name says so (``*TOKEN*``, ``*SECRET*``,
``*PASSWORD*``, ``*API_KEY*``, ``*APIKEY*``, ``*_KEY``, ``*CREDENTIAL*``), or
when the value has the shape of a known secret whatever its name (llmgw's own
tokens, ``sk-...`` keys, Hugging Face, GitHub, Slack and AWS keys, a URL with
a password): a forgotten ``secret_env`` or an unusual name should not be what
leaks a token.

Reads show :data:`REDACTED` in its place. Writing an entry back as it was read
(``ctl models show --json`` edited and applied) keeps the stored value: a
secret name whose value is :data:`REDACTED` means "unchanged".
"""

from __future__ import annotations

import re

from llmgw.errors import ValidationError
from llmgw.wire import ModelSpec

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|_KEY$|^KEY$",
                          re.IGNORECASE)
# Values that are secrets by their shape, anywhere in the value.
_SECRET_VALUE = re.compile(
    r"(?<![A-Za-z0-9])(?:llmgw-[a-z-]+-|sk-)[A-Za-z0-9_-]{16,}"  # llmgw's tokens, sk-... keys
    r"|(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}"                     # Hugging Face
    r"|(?<![A-Za-z0-9])gh[pousr]_[A-Za-z0-9]{20,}"              # GitHub
    r"|(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}"           # Slack
    r"|(?<![A-Z0-9])AKIA[0-9A-Z]{16}(?![A-Z0-9])"               # AWS access key id
    r"|[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@"          # a URL with a password
)


def is_secret_value(value: str) -> bool:
    return bool(_SECRET_VALUE.search(value))


def is_secret(spec: ModelSpec, name: str) -> bool:
    return (name in spec.secret_env or bool(_SECRET_NAME.search(name))
            or is_secret_value(spec.env.get(name, "")))


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
    # A value redacted for its shape reads back as the marker under a name
    # that says nothing: the stored value's shape decides then.
    placeholders = [k for k, v in spec.env.items() if v == REDACTED and (
        is_secret(spec, k) or (current is not None and is_secret(current, k)))]
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
