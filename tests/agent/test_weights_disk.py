"""Disk room for weights: the check before a fetch, LRU eviction, the in-use guard.

The filesystem's free space is the one thing faked (nobody can fill a disk for
a test): :class:`FakeDisk` is a disk of a fixed capacity whose used part is the
real bytes under the cache. Files, fetches, peers and the Hub API are real
(the Hub is a loopback server).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from aiohttp import web
from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane, serve_app
from tests.agent.helpers import assign, cpu_slot, model
from tests.agent.test_weights import (
    HF,
    PAYLOAD,
    Peer,
    content,
    package_source,
    plant,
    spec_of,
    staging_is_empty,
)
from tests.agent.test_weights import fake_package as fake_package
from tests.agent.test_weights import peer as peer
from tests.agent.test_weights import session as session
from tests.waiting import eventually
from typer.testing import CliRunner

from llmgw.agent import diskroom
from llmgw.agent.diskroom import DiskReserve, DiskSpace, RoomCheck, Unused
from llmgw.agent.manifest import tree_size
from llmgw.agent.weights import NotEnoughDisk, Progress, WeightsCache
from llmgw.cli.agent import app as agent_cli
from llmgw.errors import ConfigError
from llmgw.wire import ModelSpec, ReplicaState, WeightsSource

MIB = 1024 * 1024
NO_RESERVE = DiskReserve(fraction=None, size_bytes=0)
OFFLINE = "http://127.0.0.1:9"  # a closed port: any Hub download fails at once


class FakeDisk:
    """``diskroom.disk_space`` for a disk of ``capacity`` bytes holding only the cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.asked: list[Path] = []

    def __call__(self, path: Path) -> DiskSpace:
        self.asked.append(path)
        return DiskSpace(total=self.capacity, free=max(self.capacity - tree_size(path), 0))


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> FakeDisk:
    fake = FakeDisk(capacity=1 << 40)
    monkeypatch.setattr(diskroom, "disk_space", fake)
    return fake


class Ticks:
    """A clock that moves 100 s per reading: use order is never a tie."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 100.0
        return self.now


def hf(name: str) -> ModelSpec:
    return spec_of(
        WeightsSource(kind="hf", repo=f"org/{name}", revision="abc", file="m.gguf"), name
    )


def held_models(cache: WeightsCache) -> list[str]:
    return sorted(w.model for w in cache.report())


async def use(cache: WeightsCache, *specs: ModelSpec) -> None:
    for spec in specs:
        assert await cache.ensure(spec, progress=Progress()) is not None


# -- the pure parts ------------------------------------------------------------------


def test_reserve_is_the_smaller_of_5_percent_and_10_gib() -> None:
    reserve = DiskReserve()
    assert reserve.bytes_of(100 * 10**9) == 5 * 10**9
    assert reserve.bytes_of(4 * 10**12) == 10 * 1024**3
    assert DiskReserve.parse("2%").bytes_of(10**12) == 2 * 10**10
    assert DiskReserve.parse("20GiB").bytes_of(10**12) == 20 * 1024**3
    assert DiskReserve.parse("1.5 TB").bytes_of(10**15) == 15 * 10**11
    assert DiskReserve.parse("0").bytes_of(10**12) == 0
    for bad in ("lots", "5 parsecs", "100%", "-1GB", ""):
        with pytest.raises(ConfigError, match="weights reserve"):
            DiskReserve.parse(bad)


def test_refusal_names_need_free_reserve_and_what_to_do() -> None:
    check = RoomCheck(
        model="llama-70b",
        where=Path("/var/lib/llmgw/weights"),
        need=140_200_000_000,
        space=DiskSpace(total=2 * 10**12, free=48_100_000_000),
        reserve=10 * 10**9,
        pending=0,
        unused=[Unused(key="k", model="old", size_bytes=30 * 10**9, last_used=1.0)],
    )
    assert check.victims() is None  # all unused weights would still not do: keep them
    assert check.refusal() == (
        "not enough disk for weights of 'llama-70b': need 140.2 GB, 48.1 GB free in"
        " /var/lib/llmgw/weights (reserve 10.0 GB; unused weights that could be evicted:"
        " 30.0 GB); free space or move --data-dir"
    )


def test_victims_are_least_recently_used_first_and_just_enough() -> None:
    unused = [
        Unused(key="c", model="c", size_bytes=30, last_used=300.0),
        Unused(key="a", model="a", size_bytes=30, last_used=100.0),
        Unused(key="b", model="b", size_bytes=30, last_used=200.0),
    ]
    space = DiskSpace(total=1000, free=100)

    def check(need: int, pending: int = 0) -> RoomCheck:
        return RoomCheck("m", Path("/w"), need, space, reserve=10, pending=pending, unused=unused)

    assert check(90).victims() == []
    victims = check(140).victims()
    assert victims is not None and [v.key for v in victims] == ["a", "b"]
    # Bytes other downloads have yet to write are not room.
    later = check(90, pending=25).victims()
    assert later is not None and [v.key for v in later] == ["a"]
    assert check(181).victims() is None


def test_bad_reserve_flag_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        agent_cli,
        ["--control-plane", OFFLINE, "--data-dir", str(tmp_path), "--weights-reserve", "lots"],
    )
    assert result.exit_code == 2
    assert "weights reserve 'lots'" in result.output


# -- the cache ---------------------------------------------------------------------


async def test_fetch_evicts_least_recently_used_first_and_only_as_needed(
    tmp_path: Path, fake_package: str, disk: FakeDisk, caplog: pytest.LogCaptureFixture
) -> None:
    cache = WeightsCache(tmp_path / "w", reserve=NO_RESERVE, clock=Ticks())
    a, b, c = hf("a"), hf("b"), hf("c")
    for spec in (a, b, c):
        plant(cache, spec, PAYLOAD)
    await use(cache, b, c, a)  # b is the least recently used, though planted in the middle
    disk.capacity = tree_size(cache.root) + MIB // 2  # the package needs 1 MiB
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.weights"):
        path = await cache.ensure(spec_of(package_source(fake_package)), progress=Progress())
    assert path is not None and content(path) == PAYLOAD
    assert held_models(cache) == ["a", "c", "tiny"]
    [evicted] = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert evicted.startswith("evicted weights of 'b' (1.0 MB, last used ")
    assert evicted.endswith(") to make room for 'tiny'")
    assert cache.lookup(b) is None and staging_is_empty(cache)


async def test_fetch_that_fits_evicts_nothing(
    tmp_path: Path, fake_package: str, disk: FakeDisk
) -> None:
    cache = WeightsCache(tmp_path / "w", reserve=DiskReserve(fraction=None, size_bytes=MIB))
    plant(cache, hf("a"), PAYLOAD)
    disk.capacity = tree_size(cache.root) + 2 * MIB + 4096  # 1 MiB reserve + 1 MiB package
    await use(cache, spec_of(package_source(fake_package)))
    assert held_models(cache) == ["a", "tiny"]
    assert disk.asked == [cache.root]


async def test_weights_in_use_are_never_evicted(
    tmp_path: Path, fake_package: str, disk: FakeDisk
) -> None:
    cache = WeightsCache(tmp_path / "w", reserve=NO_RESERVE, clock=Ticks())
    a, b = hf("a"), hf("b")
    plant(cache, a, PAYLOAD)
    plant(cache, b, PAYLOAD)
    await use(cache, a, b)
    key_a = cache.hold(a)  # a replica runs on a: the oldest, yet it stays
    assert key_a is not None
    disk.capacity = tree_size(cache.root) + MIB // 2
    tiny = spec_of(package_source(fake_package))
    await use(cache, tiny)
    assert held_models(cache) == ["a", "tiny"]

    # Now a and tiny are both held and nothing else is left: refused, nothing deleted.
    key_tiny = cache.hold(tiny)
    assert key_tiny is not None
    with pytest.raises(NotEnoughDisk) as info:
        await cache.ensure(spec_of(package_source(fake_package), name="tiny2"), progress=Progress())
    message = str(info.value)
    assert message.startswith("not enough disk for weights of 'tiny2': need 1.0 MB, ")
    assert f"free in {cache.root} (reserve 0 B)" in message
    assert message.endswith("; free space or move --data-dir")
    assert held_models(cache) == ["a", "tiny"] and staging_is_empty(cache)

    # Let go of a: it is the one to go, tiny (held) stays.
    cache.release(key_a)
    await use(cache, spec_of(package_source(fake_package), name="tiny2"))
    assert held_models(cache) == ["tiny", "tiny2"]


async def test_operator_local_path_inside_the_cache_is_never_evicted(
    tmp_path: Path, fake_package: str, disk: FakeDisk
) -> None:
    cache = WeightsCache(tmp_path / "w", reserve=NO_RESERVE)
    placed = plant(cache, hf("a"), PAYLOAD)
    local = spec_of(WeightsSource(kind="local", path=str(placed)), "mine")
    await use(cache, local)
    disk.capacity = tree_size(cache.root) + MIB // 2
    with pytest.raises(NotEnoughDisk):
        await cache.ensure(spec_of(package_source(fake_package)), progress=Progress())
    assert placed.read_bytes() == PAYLOAD


async def test_agent_restart_keeps_the_lru_order(
    tmp_path: Path, fake_package: str, disk: FakeDisk
) -> None:
    root = tmp_path / "w"
    before = WeightsCache(root, reserve=NO_RESERVE, clock=Ticks(1000.0))
    a, b = hf("a"), hf("b")
    plant(before, a, PAYLOAD)  # both planted with the same creation time
    plant(before, b, PAYLOAD)
    await use(before, b, a)  # b first: b is older
    # A new agent on the same data dir, its clock later than the old one's.
    after = WeightsCache(root, reserve=NO_RESERVE, clock=Ticks(5000.0))
    disk.capacity = tree_size(root) + MIB // 2
    await use(after, spec_of(package_source(fake_package)))
    assert held_models(after) == ["a", "tiny"]


async def test_release_counts_as_a_use(tmp_path: Path, fake_package: str, disk: FakeDisk) -> None:
    cache = WeightsCache(tmp_path / "w", reserve=NO_RESERVE, clock=Ticks())
    a, b = hf("a"), hf("b")
    plant(cache, a, PAYLOAD)
    plant(cache, b, PAYLOAD)
    await use(cache, a, b)
    key = cache.hold(a)  # a replica ran on a until after b was last used
    assert key is not None
    cache.release(key)
    disk.capacity = tree_size(cache.root) + MIB // 2
    await use(cache, spec_of(package_source(fake_package)))
    assert held_models(cache) == ["a", "tiny"]


# -- sizes as each source knows them -------------------------------------------------


def _held_by_the_peer(peer: Peer, tmp_path: Path) -> tuple[ModelSpec, WeightsCache]:
    """A model the peer holds, and a cache of this node's with only the peer to copy from."""
    spec = spec_of(HF)
    plant(peer.cache, spec, PAYLOAD)
    return spec, WeightsCache(tmp_path / "mine", hf_endpoint=OFFLINE, reserve=NO_RESERVE)


async def test_peer_copy_makes_room_from_the_announced_size(
    tmp_path: Path,
    peer: Peer,
    disk: FakeDisk,
) -> None:
    spec, mine = _held_by_the_peer(peer, tmp_path)
    plant(mine, hf("old"), PAYLOAD)
    disk.capacity = tree_size(mine.root) + MIB // 2
    path = await peer.fetch(mine, spec)
    assert path is not None and content(path) == PAYLOAD
    assert held_models(mine) == ["tiny"]


async def test_peer_copy_that_cannot_fit_fails_before_a_byte(
    tmp_path: Path,
    peer: Peer,
    disk: FakeDisk,
) -> None:
    spec, mine = _held_by_the_peer(peer, tmp_path)
    mine.root.mkdir()
    disk.capacity = MIB // 2
    progress = Progress()
    # Not the peer's fault: no "peers failed too", and the Hub is not tried.
    with pytest.raises(
        NotEnoughDisk, match=r"^not enough disk for weights of 'tiny': need 1\.0 MB"
    ):
        await peer.fetch(mine, spec, progress)
    assert progress.done == 0 and mine.report() == [] and staging_is_empty(mine)


async def test_hub_fetch_is_refused_from_the_api_file_sizes(tmp_path: Path, disk: FakeDisk) -> None:
    asked: list[str] = []

    async def model_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response(
            {
                "id": "org/big",
                "sha": "abc",
                "siblings": [
                    {"rfilename": "big.gguf", "size": 140_200_000_000},
                    {"rfilename": "README.md", "size": 5_000},
                ],
            }
        )

    async def anything_else(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"error": "not here"}, status=404)

    hub = web.Application()
    hub.router.add_get("/api/models/org/big/revision/abc", model_info)
    hub.router.add_route("*", "/{tail:.*}", anything_else)
    disk.capacity = 48_100_000_000
    spec = spec_of(WeightsSource(kind="hf", repo="org/big", revision="abc", file="big.gguf"), "big")
    async with serve_app(hub) as url:
        cache = WeightsCache(tmp_path / "w", hf_endpoint=url)
        with pytest.raises(NotEnoughDisk) as info:
            await cache.ensure(spec, progress=Progress())
    assert str(info.value) == (
        f"not enough disk for weights of 'big': need 140.2 GB, 48.1 GB free in {cache.root}"
        " (reserve 2.4 GB); free space or move --data-dir"
    )
    assert asked == ["/api/models/org/big/revision/abc"]  # no file was asked for


# -- the agent ------------------------------------------------------------------------


async def test_replica_fails_for_disk_then_starts_once_unused_weights_can_go(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, disk: FakeDisk
) -> None:
    a = model("sim", name="a", weights=hf("a").weights, gpu_classes=["cpu"])
    b = model("sim", name="b", weights=hf("b").weights, gpu_classes=["cpu"])
    holder = make_agent("n0", hf_endpoint=OFFLINE)
    await fake_cp.wait_for(lambda r: r.node == "n0")
    plant(holder.weights, b, PAYLOAD)
    assert holder.server is not None
    fake_cp.weight_peers = {"b": [f"http://127.0.0.1:{holder.server.port}"]}

    node = make_agent("n1", hf_endpoint=OFFLINE, weights_reserve=NO_RESERVE)
    await fake_cp.wait_for(lambda r: r.node == "n1")
    plant(node.weights, a, PAYLOAD)
    disk.capacity = tree_size(node.weights.root) + MIB // 2
    run_a = assign(a, [cpu_slot(0)], replica_id="ra")
    fake_cp.assignments["n1"] = [run_a]
    await fake_cp.wait_state("ra", ReplicaState.READY)

    # a is in use: b cannot have its room, and the replica says why.
    fake_cp.assignments["n1"] = [run_a, assign(b, [cpu_slot(1)], replica_id="rb")]
    failed = await fake_cp.wait_state("rb", ReplicaState.FAILED)
    assert failed.reason is not None
    assert failed.reason.startswith("not enough disk for weights of 'b': need 1.0 MB, ")
    assert failed.reason.endswith("free space or move --data-dir")
    assert node.weights.lookup(a) is not None

    # a's replica goes; the next generation of b evicts a's weights and runs.
    fake_cp.assignments["n1"] = [assign(b, [cpu_slot(1)], replica_id="rb")]
    # Its record goes once its engine has stopped, in the step that lets go of a.
    await eventually(lambda: "ra" not in node.state.load(), 15, what="replica ra stopped")
    fake_cp.assignments["n1"] = [assign(b, [cpu_slot(1)], replica_id="rb", generation=2)]
    await fake_cp.wait_state("rb", ReplicaState.READY)
    report = await fake_cp.wait_for(lambda r: r.node == "n1")
    assert [w.model for w in report.weights] == ["b"]
