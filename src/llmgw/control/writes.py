"""The control plane's one way to write to the store: every write fenced.

Each method is the store's own, called with the leader's current epoch
(llmgw.control.leader.Leadership), so the store commits it only while that
epoch is still the newest. A refused write (NotLeaderError) means another
instance has taken over while this one had not noticed: the write is lost,
as it must be, and this instance steps down at once (Leadership.stale)
instead of answering more requests, or running more passes, as a leader.

Every write, not the reconcile pass alone: an unfenced write lets a deposed
leader change the catalog, node states, drains and keys after its successor
took over. Reads need no fence and go to the store directly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from llmgw.control.leader import Leadership
from llmgw.control.store.repo import Row, Store
from llmgw.errors import NotLeaderError

T = TypeVar("T")


class FencedWrites:
    def __init__(self, store: Store, leadership: Leadership) -> None:
        self.store = store
        self.leadership = leadership

    async def _fenced(self, write: Callable[[int | None], Awaitable[T]]) -> T:
        try:
            return await write(self.leadership.epoch)
        except NotLeaderError:
            self.leadership.stale()
            raise

    async def claim_address(self, address: str, node: str, at: float) -> str:
        return await self._fenced(
            lambda epoch: self.store.claim_address(address, node, at, epoch=epoch))

    async def free_address(self, address: str) -> str | None:
        return await self._fenced(lambda epoch: self.store.free_address(address, epoch=epoch))

    async def set_setting(self, key: str, value: str) -> None:
        await self._fenced(lambda epoch: self.store.set_setting(key, value, epoch=epoch))

    async def upsert_nodes(self, rows: Sequence[Row]) -> None:
        await self._fenced(lambda epoch: self.store.upsert_nodes(rows, epoch=epoch))

    async def touch_nodes(self, last_seen: dict[str, float]) -> None:
        await self._fenced(lambda epoch: self.store.touch_nodes(last_seen, epoch=epoch))

    async def touch_replicas(self, activity: dict[str, tuple[int, float | None]]) -> None:
        await self._fenced(lambda epoch: self.store.touch_replicas(activity, epoch=epoch))

    async def replace_gpus(self, node: str, rows: Sequence[Row]) -> None:
        await self._fenced(lambda epoch: self.store.replace_gpus(node, rows, epoch=epoch))

    async def delete_node(self, name: str) -> None:
        await self._fenced(lambda epoch: self.store.delete_node(name, epoch=epoch))

    async def upsert_models(self, rows: Sequence[Row]) -> None:
        await self._fenced(lambda epoch: self.store.upsert_models(rows, epoch=epoch))

    async def delete_models(self, names: Iterable[str]) -> None:
        await self._fenced(lambda epoch: self.store.delete_models(names, epoch=epoch))

    async def write_replicas(
        self,
        upserts: Sequence[Row],
        deletes: Iterable[str] = (),
        *,
        epoch: int | None = None,
        events: Sequence[Row] = (),
        models: Sequence[Row] = (),
    ) -> None:
        """``epoch``: the one a reconcile pass was decided under; an older one is refused."""

        async def write(current: int | None) -> None:
            if epoch is not None and epoch != current:
                raise NotLeaderError(f"leader epoch {epoch} is stale (now {current})")
            await self.store.write_replicas(
                upserts, deletes, epoch=current, events=events, models=models)

        await self._fenced(write)

    async def add_events(self, rows: Sequence[Row]) -> None:
        await self._fenced(lambda epoch: self.store.add_events(rows, epoch=epoch))

    async def add_api_key(self, row: Row) -> None:
        await self._fenced(lambda epoch: self.store.add_api_key(row, epoch=epoch))

    async def update_api_key(self, key_id: str, values: Row) -> bool:
        return await self._fenced(
            lambda epoch: self.store.update_api_key(key_id, values, epoch=epoch))

    async def add_team(self, row: Row) -> None:
        await self._fenced(lambda epoch: self.store.add_team(row, epoch=epoch))

    async def update_team(self, team_id: str, values: Row) -> bool:
        return await self._fenced(
            lambda epoch: self.store.update_team(team_id, values, epoch=epoch))

    async def delete_team(self, team_id: str) -> bool:
        return await self._fenced(lambda epoch: self.store.delete_team(team_id, epoch=epoch))

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._fenced(lambda epoch: self.store.revoke_api_key(key_id, epoch=epoch))

    async def add_usage(self, rows: Sequence[Row]) -> None:
        # Not fenced, on purpose: usage counts are facts a gateway observed,
        # added, never overwritten, and a standby's in-process gateway
        # (llmgw up) records its own rather than lose them. Nothing a deposed
        # leader adds here can undo what its successor decided.
        await self.store.add_usage(rows)

    async def prune_events(self, *, before_at: float) -> int:
        return await self._fenced(
            lambda epoch: self.store.prune_events(before_at=before_at, epoch=epoch))

    async def prune_usage(self, *, before_minute: int) -> int:
        return await self._fenced(
            lambda epoch: self.store.prune_usage(before_minute=before_minute, epoch=epoch))
