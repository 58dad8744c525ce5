"""How a client moves between control-plane instances (llmgw.failover)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web
from tests.servers import free_port

from llmgw.errors import ConfigError, ControlPlaneUnavailable
from llmgw.failover import (
    LeaderFinder,
    parse_control_plane_urls,
    standby_hint,
)
from llmgw.wire import LEADER_HEADER, STANDBY_CODE

A, B, C = "http://a:1", "http://b:1", "http://c:1"
STANDBY_BODY = orjson.dumps({"error": {"message": "standby", "type": "standby_error",
                                       "code": STANDBY_CODE}})


def test_urls_parse_from_one_flag_or_several() -> None:
    assert parse_control_plane_urls("http://a:8080") == ["http://a:8080"]
    assert parse_control_plane_urls(" http://a:8080/ , https://b ,,") == [
        "http://a:8080", "https://b"]
    assert parse_control_plane_urls(["http://a,http://b", "http://a"]) == ["http://a", "http://b"]
    with pytest.raises(ConfigError, match="must start with http"):
        parse_control_plane_urls("http://a,b:8080")
    with pytest.raises(ConfigError, match="no control plane URL"):
        parse_control_plane_urls(" , ")


def test_a_standby_answer_is_told_apart_from_other_503s() -> None:
    assert standby_hint(503, {LEADER_HEADER: "http://l:8080/"}, STANDBY_BODY) == (
        True, "http://l:8080")
    assert standby_hint(503, {}, STANDBY_BODY) == (True, None)
    assert standby_hint(503, {LEADER_HEADER: "not a url"}, STANDBY_BODY) == (True, None)
    store_down = orjson.dumps({"error": {"message": "x", "type": "store_error", "code": None}})
    assert standby_hint(503, {LEADER_HEADER: A}, store_down) == (False, None)
    assert standby_hint(503, {}, b"<html>bad gateway</html>") == (False, None)
    assert standby_hint(200, {LEADER_HEADER: A}, STANDBY_BODY) == (False, None)


def test_moves_follow_hints_then_the_list() -> None:
    finder = LeaderFinder([A, B, C])
    assert finder.current == A
    finder.standby(A, C)  # a hint in the list: go there
    assert finder.current == C
    finder.unreachable(C)
    assert finder.current == A  # wraps around
    # A hint outside the list, or to a configured host over another scheme,
    # is not followed: the next call would carry a bearer token there.
    finder.standby(A, "http://elsewhere:1")
    assert finder.current == B
    finder.standby(B, "https://c:1")
    assert finder.current == C
    finder.standby(C, None)
    assert finder.current == A
    finder.standby(A, B)
    assert finder.current == B
    finder.standby(B, None)  # no hint: next in the list
    assert finder.current == C
    finder.standby(C, C)  # a hint naming itself is no hint
    assert finder.current == A


def test_a_failure_already_acted_on_does_not_move_again() -> None:
    finder = LeaderFinder([A, B, C])
    finder.unreachable(A)  # the long poll failed...
    finder.unreachable(A)  # ...and so did a load report sent to A at the same time
    assert finder.current == B
    finder.standby(A, C)
    assert finder.current == B


def test_a_walk_tries_each_instance_once_when_asked() -> None:
    # llmgw ctl: a refused write goes once to the leader named, never back.
    finder = LeaderFinder([A, B])
    walk = finder.walk(once_each=True)
    steps = iter(walk)
    assert next(steps) == A
    walk.standby(A, B)
    assert next(steps) == B
    walk.standby(B, A)  # B lost the lead a moment ago and names A
    assert list(steps) == []
    assert walk.saw_standby
    assert walk.summary() == f"{A}: standby (leader: {B}); {B}: standby (leader: {A})"


def test_a_walk_without_once_each_stops_at_twice_the_instances() -> None:
    finder = LeaderFinder([A, B])
    walk = finder.walk()
    tried = []
    for url in walk:
        tried.append(url)
        walk.unreachable(url, "refused")
    assert tried == [A, B, A, B]
    assert not walk.saw_standby and walk.summary().count("refused") == 4


Start = Callable[[str, str | None], Awaitable[str]]


@pytest.fixture
async def instances() -> AsyncIterator[Start]:
    """Tiny servers that answer as the leader, or as a standby naming a URL."""
    runners: list[web.AppRunner] = []

    async def start(role: str, hint: str | None) -> str:
        async def handle(_: web.Request) -> web.Response:
            if role == "leader":
                return web.Response(body=b"leader here")
            headers = {LEADER_HEADER: hint} if hint else {}
            return web.Response(status=503, body=STANDBY_BODY, headers=headers,
                                content_type="application/json")

        app = web.Application()
        app.router.add_post("/call", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_one_call_reaches_the_leader_through_a_dead_instance_and_a_standby(
    instances: Start,
) -> None:
    leader = await instances("leader", None)
    standby = await instances("standby", leader)
    dead = f"http://127.0.0.1:{free_port()}"
    # The hint skips the standby that knows no leader, listed before the leader.
    lost = await instances("standby", None)
    finder = LeaderFinder([dead, standby, lost, leader])
    async with aiohttp.ClientSession() as session:
        answer = await finder.request(session, "POST", "/call")
        assert (answer.url, answer.status, answer.body) == (leader, 200, b"leader here")
        assert finder.current == leader  # sticky: the next call goes straight there


async def test_a_hint_to_an_instance_not_configured_is_not_followed(instances: Start) -> None:
    # Where a standby (or whoever answers in its place) names a host of its
    # choosing, the call with its bearer token must not go there.
    decoy = await instances("leader", None)
    standby = await instances("standby", decoy)
    other_scheme = await instances("standby", standby.replace("http://", "https://"))
    finder = LeaderFinder([standby, other_scheme])
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ControlPlaneUnavailable, match="not followed") as caught:
            await finder.request(session, "POST", "/call")
    assert f"leader: {decoy}, not followed" in str(caught.value)
    assert finder.current in (standby, other_scheme)


async def test_standbys_that_know_no_leader_end_in_an_error_not_a_loop(
    instances: Start,
) -> None:
    lost = await instances("standby", None)
    finder = LeaderFinder([lost, f"http://127.0.0.1:{free_port()}"])
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ControlPlaneUnavailable, match="standby") as caught:
            await finder.request(session, "POST", "/call")
    assert "Connect" in str(caught.value)


async def test_standbys_whose_hints_name_each_other_do_not_bounce_a_call_forever() -> None:
    # Possible for a moment around a failover: each read the store's leader
    # URL before the other took over.
    first_port, second_port = free_port(), free_port()
    first, second = f"http://127.0.0.1:{first_port}", f"http://127.0.0.1:{second_port}"
    runners: list[web.AppRunner] = []
    for port, names in ((first_port, second), (second_port, first)):
        async def handle(_: web.Request, names: str = names) -> web.Response:
            return web.Response(status=503, body=STANDBY_BODY, headers={LEADER_HEADER: names},
                                content_type="application/json")

        app = web.Application()
        app.router.add_post("/call", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    try:
        finder = LeaderFinder([first])
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ControlPlaneUnavailable) as caught:
                await finder.request(session, "POST", "/call")
        assert str(caught.value).count("standby") == 2  # twice the one URL given
    finally:
        for runner in runners:
            await runner.cleanup()
