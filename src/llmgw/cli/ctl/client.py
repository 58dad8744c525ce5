"""Where ``llmgw ctl`` connects, with what token, and how its failures read.

Where to connect and with what, first found wins: ``--url``/``--token``,
then ``LLMGW_URL``/``LLMGW_ADMIN_TOKEN``, then ``up.json`` in the data dir
(written by ``llmgw up`` and ``llmgw serve``), then http://127.0.0.1:8080.

A control plane that cannot be reached, or refuses the token, is one line
on stderr and exit code 1: someone typing ``ctl status`` during an incident
needs the reason, not a traceback.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import httpx
import typer

from llmgw.config import default_data_dir

DEFAULT_URL = "http://127.0.0.1:8080"
ADMIN_PREFIX = "/admin/v1"
# Long enough for a summary of a large fleet on a busy control plane, short
# enough that a black-holed address fails while someone is still looking.
REQUEST_TIMEOUT_S = 15.0
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


class AdminClient:
    """The admin API over HTTP; every failure becomes a CtlError with one line."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/").removesuffix(ADMIN_PREFIX)
        self._http = httpx.Client(
            base_url=self.base_url + ADMIN_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=REQUEST_TIMEOUT_S,
        )

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, *, body: Any = None,
             params: dict[str, Any] | None = None) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, json=body, params=clean)
        except httpx.TimeoutException:
            raise CtlError(f"the control plane at {self.base_url} did not answer within "
                           f"{REQUEST_TIMEOUT_S:g} s") from None
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise CtlError(f"cannot reach the control plane at {self.base_url}: {reason}") from None
        if response.status_code == 401:
            raise CtlError(f"the control plane at {self.base_url} refused the admin token "
                           "(pass --token, set LLMGW_ADMIN_TOKEN, or check up.json)")
        if response.status_code >= 400:
            raise CtlError(_error_text(response))
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CtlError(f"{self.base_url} answered {path} with something that is not JSON; "
                           "is this an llmgw control plane?") from None


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        first = response.text.strip().splitlines()[0] if response.text.strip() else ""
        message = f"HTTP {response.status_code} {first[:200]}".strip()
    return str(message)


def admin_client(ctx: typer.Context) -> AdminClient:
    """The client for this invocation, from the options the app's callback stored."""
    settings: Settings = ctx.obj or Settings()
    url, token = settings.url, settings.token
    if not url or not token:
        up = _up_json(settings.data_dir)
        url = url or up.get("admin_url") or DEFAULT_URL
        token = token or up.get("admin_token")
    if not token:
        raise CtlError("no admin token: pass --token, set LLMGW_ADMIN_TOKEN, "
                       "or run `llmgw up` (it writes one to up.json)")
    return AdminClient(str(url), str(token))


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

