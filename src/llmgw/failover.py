"""How agents and gateways find the control-plane leader among several instances.

``llmgw serve`` may run as a leader and hot standbys on one PostgreSQL store
(docs/install.md). Only the leader may take agent reports and gateway writes,
so a client given several URLs sends each call to the instance it last found
leading and moves on when that stops working:

- a standby answer (HTTP 503, error code ``wire.STANDBY_CODE``) names the
  leader in ``wire.LEADER_HEADER`` when it knows it: go there next if that
  URL is one of the configured ones (scheme included); otherwise, or without
  a name, try the next configured URL. A hint is never followed elsewhere:
  the next call carries a bearer token, and a standby (or whoever answers in
  its place) must not be able to send it to a host, or over a scheme, that
  the operator did not choose (docs/security.md);
- a connection error or timeout: try the next configured URL.

One call tries at most twice as many instances as are configured, without
sleeping in between; when none took it, it fails with
:class:`~llmgw.errors.ControlPlaneUnavailable` and the caller's own backoff decides when to
try again. The cap is what stops two standbys whose hints name each other
(each read the store just before a failover) from bouncing a call forever.
A caller with no backoff of its own (a person typing ``llmgw ctl``) asks for
``once_each``: each instance is tried at most once per call, so a refused
write goes once to the leader named, and a list of dead instances costs one
timeout each, not two.

:class:`LeaderFinder` keeps where calls go; :class:`CallWalk` is one call's
way through the instances, apart from the HTTP library, so that the async
clients (:meth:`LeaderFinder.request`, aiohttp) and the synchronous ``llmgw
ctl`` (httpx) share these rules instead of each keeping a copy.

Used through llmgw.cpclient (which adds CA trust and reads statuses) by the
agent, the standalone gateway and the simulated fleet, and directly by
``llmgw ctl`` (llmgw.cli.ctl.client); it imports none of them, nor the
control plane.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from llmgw.errors import ConfigError, ControlPlaneUnavailable
from llmgw.wire import LEADER_HEADER, ErrorBody


def parse_control_plane_urls(value: str | Sequence[str]) -> list[str]:
    """``"http://a:8080, http://b:8080"`` (or a list of such strings) as clean URLs.

    Comma-separated so that one ``--control-plane`` flag or one
    ``LLMGW_CONTROL_PLANE`` variable can carry them all; a single URL reads as
    it always did.
    """
    items = [value] if isinstance(value, str) else list(value)
    urls: list[str] = []
    for item in items:
        for part in item.split(","):
            url = part.strip().rstrip("/")
            if not url:
                continue
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"control plane URL {url!r} must start with http:// or https://"
                )
            if url not in urls:
                urls.append(url)
    if not urls:
        raise ConfigError("no control plane URL given")
    return urls


@dataclass(frozen=True)
class Answer:
    """A control-plane instance's answer that was not a standby's refusal."""

    url: str
    status: int
    body: bytes


def standby_hint(status: int, headers: Mapping[str, str], body: bytes) -> tuple[bool, str | None]:
    """(is this a standby's refusal, the leader URL it names if any)."""
    if status != 503:
        return False, None
    error = ErrorBody.parse(body)
    if error is None or not error.from_standby:
        return False, None
    hint = (headers.get(LEADER_HEADER) or "").strip().rstrip("/")
    return True, hint if hint.startswith(("http://", "https://")) else None


class LeaderFinder:
    """The configured instances and the one calls go to now (sticky until it fails)."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        self.urls = parse_control_plane_urls(urls)
        self._index = 0
        # Verifies https:// instances (the fleet's CA, llmgw.tls); None: the
        # system's CAs. Set by the owner once it trusts a CA.
        self.ssl: ssl.SSLContext | None = None

    @property
    def current(self) -> str:
        return self.urls[self._index]

    def unreachable(self, url: str) -> None:
        # Concurrent calls (a gateway's long poll beside its load reports) may
        # both fail on one instance; only the first moves on, or the second
        # would skip a healthy instance.
        if url == self.current:
            self._move_on()

    def standby(self, url: str, hint: str | None) -> None:
        if url != self.current:
            return
        if hint and hint != url and hint in self.urls:
            self._index = self.urls.index(hint)
        else:
            self._move_on()

    def _move_on(self) -> None:
        self._index = (self._index + 1) % len(self.urls)

    async def request(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        *,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Callable[[str], Mapping[str, int | str]] | None = None,
        limits: aiohttp.ClientTimeout | None = None,
        once_each: bool = False,
    ) -> Answer:
        """Send one call to the leader, moving between instances as described above.

        ``params`` is asked per instance tried: a query may depend on where it
        goes (the gateway's routing version means something only to the
        instance that issued it). ``once_each``: see the module's docstring.
        """
        walk = self.walk(once_each=once_each)
        for url in walk:
            try:
                async with session.request(
                    method, url + path, data=data, headers=headers,
                    params=params(url) if params is not None else None, timeout=limits,
                    ssl=self.ssl if self.ssl is not None else True,
                    # Never followed: aiohttp resends the body on a 307/308,
                    # and a registration's body is the join token. A redirect
                    # is an answer like any other status (and not a 2xx).
                    allow_redirects=False,
                ) as response:
                    body = await response.read()
                    status = response.status
                    is_standby, hint = standby_hint(status, response.headers, body)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                walk.unreachable(url, repr(exc))
                continue
            if is_standby:
                walk.standby(url, hint)
                continue
            return Answer(url=url, status=status, body=body)
        raise ControlPlaneUnavailable(
            f"{method} {path}: no control plane took the call: {walk.summary()}",
            standby_answered=walk.standby_answered,
        )

    def walk(self, *, once_each: bool = False) -> CallWalk:
        """One call's way through the instances (for callers with their own HTTP client)."""
        return CallWalk(self, once_each=once_each)


class CallWalk:
    """Where one call goes next, and what each instance it tried said.

    Iterate for the URL to try; report each failure with :meth:`unreachable`
    or :meth:`standby` (which move the finder on) before the next step. The
    iteration ends when the cap is spent, or with ``once_each`` when the next
    instance was already tried in this call.
    """

    def __init__(self, finder: LeaderFinder, *, once_each: bool = False) -> None:
        self.finder = finder
        self.once_each = once_each
        # (url, what happened), in the order tried: the caller's error names them.
        self.tried: list[tuple[str, str]] = []
        self._left = 2 * len(finder.urls)

    def __iter__(self) -> Iterator[str]:
        while self._left > 0:
            url = self.finder.current
            if self.once_each and any(url == seen for seen, _ in self.tried):
                return
            self._left -= 1
            yield url

    def unreachable(self, url: str, problem: str) -> None:
        """``url`` did not answer (``problem`` says how)."""
        self.tried.append((url, problem))
        self.finder.unreachable(url)

    @property
    def standby_answered(self) -> bool:
        """Whether any instance tried in this call answered as a standby."""
        return any(what.startswith("standby") for _, what in self.tried)

    def standby(self, url: str, hint: str | None) -> None:
        """``url`` is a standby; ``hint`` is the leader it named, if any."""
        if hint and hint not in self.finder.urls:
            hint += ", not followed: not a configured instance"
        self.tried.append((url, "standby" + (f" (leader: {hint})" if hint else "")))
        self.finder.standby(url, hint)

    @property
    def saw_standby(self) -> bool:
        return any(what.startswith("standby") for _, what in self.tried)

    def summary(self) -> str:
        """``"http://a: standby (leader: http://b); http://b: <problem>"``."""
        return "; ".join(f"{url}: {what}" for url, what in self.tried)
