"""The admin API of whichever control-plane instance leads, as an operator's client sees it.

Calls go to the instance that answered last; a standby's 503 or a refused
connection moves on to the next instance, as ``llmgw ctl`` does, until
``retry_s`` has passed (0: each instance once).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


class Admin:
    def __init__(self, urls: list[str], token: str) -> None:
        self.urls = list(urls)
        self._current = 0
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=3.0),
                                       headers={"Authorization": f"Bearer {token}"})

    async def close(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, body: Any = None, *,
                   retry_s: float = 30.0) -> httpx.Response:
        deadline = time.monotonic() + retry_s
        last: httpx.Response | Exception | None = None
        while True:
            for _ in range(len(self.urls)):
                url = self.urls[self._current]
                try:
                    answer = await self._http.request(method, f"{url}/admin/v1{path}", json=body)
                except httpx.HTTPError as exc:
                    last = exc
                else:
                    if answer.status_code != 503:
                        return answer
                    last = answer
                self._current = (self._current + 1) % len(self.urls)
            if time.monotonic() >= deadline:
                if isinstance(last, Exception):
                    raise last
                assert last is not None
                return last
            await asyncio.sleep(0.25)

    async def get(self, path: str, **kwargs: Any) -> Any:
        answer = await self.call("GET", path, **kwargs)
        answer.raise_for_status()
        return answer.json()

    async def leader(self) -> tuple[str, int] | None:
        """(URL, epoch) of the instance that says it leads, if one does."""
        for url in self.urls:
            try:
                state = (await self._http.get(f"{url}/healthz", timeout=2.0)).json()
            except (httpx.HTTPError, ValueError):
                continue
            if state.get("leader") is True:
                return url, int(state.get("epoch") or 0)
        return None

    async def leader_get(self, path: str) -> Any | None:
        """A read from the leader itself (a standby's views lag by seconds), or None."""
        found = await self.leader()
        if found is None:
            return None
        try:
            answer = await self._http.get(f"{found[0]}/admin/v1{path}")
        except httpx.HTTPError:
            return None
        return answer.json() if answer.status_code == 200 else None
