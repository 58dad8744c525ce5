"""Where ``llmgw ctl`` connects, with what token, and how its failures read.

Where to connect and with what, first found wins: ``--url``/``--token``,
then ``LLMGW_URL``/``LLMGW_ADMIN_TOKEN``, then ``up.json`` in the data dir
(written by ``llmgw up`` and ``llmgw serve``), then http://127.0.0.1:8080.
The address may list several control-plane instances (leader and standbys),
comma-separated, or as a JSON list in ``up.json``'s ``admin_url``.

A control plane that cannot be reached, or refuses the token, is one line
on stderr and exit code 1: someone typing ``ctl status`` during an incident
needs the reason, not a traceback. With several instances the line names
each one tried and what it said.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import httpx
import typer

from llmgw.cli.ctl.render import clean, cleaned
from llmgw.config import default_data_dir
from llmgw.errors import ConfigError
from llmgw.failover import CallWalk, LeaderFinder, parse_control_plane_urls, standby_hint
from llmgw.tls import (
    TrustError,
    check_plain_urls,
    client_context,
    fingerprint,
    refuse_node_certificates,
    token_with_fingerprint,
)
from llmgw.wire import ErrorBody

DEFAULT_URL = "http://127.0.0.1:8080"
ADMIN_PREFIX = "/admin/v1"
# Long enough for a summary of a large fleet on a busy control plane, short
# enough that a black-holed address fails while someone is still looking.
REQUEST_TIMEOUT_S = 15.0
# With several instances listed, a dead one costs this before the next is
# tried; a control plane on a working network accepts in milliseconds.
CONNECT_TIMEOUT_S = 5.0
EXIT_ERROR = 1

P = ParamSpec("P")
R = TypeVar("R")


class CtlError(Exception):
    """A problem to show as one line (exit code 1)."""


@dataclass
class Settings:
    url: str | None = None
    token: str | None = None
    data_dir: Path | None = None
    ca_file: Path | None = None
    insecure_http: bool = False


def _up_json(data_dir: Path | None) -> dict[str, Any]:
    path = (data_dir or default_data_dir()) / "up.json"
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise CtlError(f"{path} is not valid JSON; remove it or pass --url and --token") from None
    return data if isinstance(data, dict) else {}


def follow_admin_token(ctx: typer.Context, new_token: str) -> Path | None:
    """Write a rotated admin token to up.json when that is where this ctl took the old one.

    Only then: an up.json of another fleet (``--url`` and ``--token`` given)
    is left alone. Written owner-only and replaced whole, as serve writes it.
    """
    settings: Settings = ctx.obj or Settings()
    path = (settings.data_dir or default_data_dir()) / "up.json"
    up = _up_json(settings.data_dir)
    if not up.get("admin_token") or (settings.token and settings.token != up["admin_token"]):
        return None
    up["admin_token"] = new_token
    partial = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(up, out, indent=2)
        os.replace(partial, path)
    except OSError as exc:
        raise CtlError(f"the new admin token could not be written to {path} "
                       f"({exc.strerror or exc}); it is printed above") from None
    return path


def _pin_of(ca_file: Path) -> str | None:
    try:
        return fingerprint(ca_file.read_bytes())
    except TrustError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read CA file {ca_file}: {exc.strerror or exc}") from None


class AdminClient:
    """The admin API over HTTP; every failure becomes a CtlError with one line.

    Given several instances, it walks them as llmgw.failover says, each at
    most once per call: a read is served by the first that answers (a standby
    serves reads), a write refused by a standby goes to the leader it names,
    or else to the next URL. Within one invocation calls stay where the last
    one was taken, so ``status --watch`` keeps reading one instance.
    """

    def __init__(self, urls: str | Sequence[str], token: str, *, ca_file: Path | None = None,
                 insecure_http: bool = False) -> None:
        try:
            parsed = parse_control_plane_urls(urls)
            # The admin token must not cross a network in the clear (llmgw.tls).
            check_plain_urls(parsed, allowed=insecure_http, what="control plane")
            # The system's CAs without --ca-file; a node's certificate is refused
            # either way (llmgw.tls), even from an operator's CA the system trusts.
            verify = (client_context(ca_file) if ca_file
                      else refuse_node_certificates(ssl.create_default_context()))
            # Join tokens this ctl prints carry it, so agents trust the same CA;
            # a file of several CAs (the system's bundle) pins none of them.
            self.ca_fingerprint = _pin_of(ca_file) if ca_file else None
        except ConfigError as exc:
            raise CtlError(str(exc)) from None
        # ``--url http://cp:8080/admin/v1`` works too: people paste what the banner shows.
        self.leader = LeaderFinder([url.removesuffix(ADMIN_PREFIX) for url in parsed])
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            verify=verify,
        )

    def close(self) -> None:
        self._http.close()

    def join_token_for_agents(self, secret: str) -> str:
        """A new join token as agents take it: with the CA's fingerprint under TLS (llmgw.tls)."""
        return token_with_fingerprint(secret, self.ca_fingerprint)

    def call(self, method: str, path: str, *, body: Any = None,
             params: dict[str, Any] | None = None, text: bool = False) -> Any:
        """The answer's JSON; its text instead with ``text`` (a CSV download)."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        walk = self.leader.walk(once_each=True)
        for url in walk:
            try:
                response = self._http.request(method, url + ADMIN_PREFIX + path, json=body,
                                              params=clean)
            except httpx.HTTPError as exc:
                walk.unreachable(url, _transport_problem(exc))
                if method != "GET" and not isinstance(exc, _NOT_SENT):
                    # The request may have reached it and been acted on: sent
                    # elsewhere, a standby would pass it back to the leader and
                    # a second key would be created, a second catalog applied.
                    raise CtlError(f"{_failure(walk, method, path)} (not retried elsewhere: "
                                   "it may have been applied)") from None
                continue
            is_standby, hint = standby_hint(response.status_code, response.headers,
                                            response.content)
            if is_standby:
                walk.standby(url, hint)
                continue
            return _answer(url, path, response, text=text)
        raise CtlError(_failure(walk, method, path))


# Failures before the request left this machine: safe to send elsewhere, writes included.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def _transport_problem(exc: httpx.HTTPError) -> str:
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (f"its TLS certificate is not signed by the CA this ctl trusts ({exc}); "
                "pass --ca-file (serve's data dir: tls/ca.pem)")
    if isinstance(exc, httpx.TimeoutException):
        limit = CONNECT_TIMEOUT_S if isinstance(exc, httpx.ConnectTimeout) else REQUEST_TIMEOUT_S
        return f"no answer within {limit:g} s"
    return str(exc) or type(exc).__name__


def _failure(walk: CallWalk, method: str, path: str) -> str:
    """One line naming every instance tried and what it said."""
    if walk.saw_standby:
        return f"no control-plane leader took {method} {path} (tried {walk.summary()})"
    # One instance reads as it always did: "cannot reach the control plane at URL: why".
    return "cannot reach the control plane at " + walk.summary()


def _answer(url: str, path: str, response: httpx.Response, *, text: bool = False) -> Any:
    if response.status_code == 401:
        raise CtlError(f"the control plane at {url} refused the admin token "
                       "(pass --token, set LLMGW_ADMIN_TOKEN, or check up.json)")
    if response.status_code >= 400:
        raise CtlError(_error_text(response))
    # Everything ctl shows passes here first: answers carry what nodes and
    # engines wrote, which must not reach the terminal as control codes.
    if text:
        return clean(response.text)
    if not response.content:
        return None
    try:
        return cleaned(response.json())
    except ValueError:
        raise CtlError(f"{url} answered {path} with something that is not JSON; "
                       "is this an llmgw control plane?") from None


def _error_text(response: httpx.Response) -> str:
    body = ErrorBody.parse(response.content)
    if body is not None:
        return clean(body.error.message)
    first = response.text.strip().splitlines()[0] if response.text.strip() else ""
    return clean(f"HTTP {response.status_code} {first[:200]}".strip())


def admin_client(ctx: typer.Context) -> AdminClient:
    """The client for this invocation, from the options the app's callback stored."""
    settings: Settings = ctx.obj or Settings()
    urls: str | list[str] | None = settings.url
    token = settings.token
    ca_file = settings.ca_file
    if not urls or not token or not ca_file:
        up = _up_json(settings.data_dir)
        urls = urls or _up_json_urls(up, settings.data_dir) or DEFAULT_URL
        token = token or up.get("admin_token")
        # serve under TLS records its CA there, for ctl on the same machine.
        ca_file = ca_file or (Path(up["ca_file"]) if isinstance(up.get("ca_file"), str)
                              else None)
    if not token:
        raise CtlError("no admin token: pass --token, set LLMGW_ADMIN_TOKEN, "
                       "or run `llmgw up` (it writes one to up.json)")
    return AdminClient(urls, str(token), ca_file=ca_file, insecure_http=settings.insecure_http)


def _up_json_urls(up: dict[str, Any], data_dir: Path | None) -> str | list[str] | None:
    # up.json names one instance; an operator with several may write a
    # comma-separated string or a list there, as on the command line.
    value = up.get("admin_url")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    path = (data_dir or default_data_dir()) / "up.json"
    raise CtlError(f"{path}: admin_url must be a URL, comma-separated URLs, or a list of URLs")


def guarded(fn: Callable[P, R]) -> Callable[P, R]:
    """One line and exit code 1 for any CtlError."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except CtlError as exc:
            typer.echo(f"llmgw ctl: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper

