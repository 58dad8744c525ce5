"""The role table, the role map and the ``--oidc-*`` checks, without a provider."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from tests.control.planekit import opened_plane

from llmgw.control.access.rolemap import principal_from_claims
from llmgw.control.access.roles import (
    ADMIN_TOKEN,
    GRANTS,
    ROUTE_ACTIONS,
    Action,
    Principal,
    Role,
    route_action,
)
from llmgw.control.access.settings import oidc_settings, parse_role_map
from llmgw.control.adminapi.routes import build_admin_router
from llmgw.errors import ConfigError, ForbiddenError


async def test_every_admin_route_has_chosen_its_action(tmp_path: Path) -> None:
    async with opened_plane(tmp_path) as (cp, _):
        routes = [r for r in build_admin_router(cp).routes if isinstance(r, APIRoute)]
    unclassified = sorted(r.name for r in routes if r.name not in ROUTE_ACTIONS)
    assert not unclassified, f"add these admin routes to ROUTE_ACTIONS: {unclassified}"
    # Every read that a viewer may make is a GET: a viewer never changes anything.
    for route in routes:
        if Role.VIEWER in {r for r in Role if route_action(route.name) in GRANTS[r]}:
            assert route.methods == {"GET"}, route.name


def test_an_unknown_route_is_admin_only() -> None:
    assert route_action("something_new") is Action.TRUST
    assert [r for r in Role if Action.TRUST in GRANTS[r]] == [Role.ADMIN]


def test_the_matrix() -> None:
    may = {role: {a for a in Action if a in GRANTS[role]} for role in Role}
    assert may[Role.ADMIN] == set(Action)
    assert Action.FLEET_OPERATE in may[Role.OPERATOR]
    assert not {Action.KEYS_WRITE, Action.TEAMS_WRITE, Action.TRUST} & may[Role.OPERATOR]
    assert not {Action.FLEET_OPERATE, Action.KEYS_WRITE, Action.TEAMS_WRITE} & may[Role.VIEWER]
    assert Action.FLEET_READ not in may[Role.TEAM_ADMIN]
    assert ADMIN_TOKEN.may(Action.TRUST)


def test_a_refusal_says_what_and_who_may() -> None:
    viewer = Principal("u1", frozenset({Role.VIEWER}), name="vic@example.test")
    with pytest.raises(ForbiddenError) as refused:
        viewer.require(Action.FLEET_OPERATE, "POST /nodes/{name}/cordon")
    assert str(refused.value) == (
        "POST /nodes/{name}/cordon needs fleet.operate, which roles admin, operator have;"
        " vic@example.test has role viewer")


def test_team_admins_are_bounded_to_their_teams_and_fleet_roles_are_not() -> None:
    lead = Principal("u2", frozenset({Role.TEAM_ADMIN}), frozenset({"team-a"}))
    assert lead.team_scope(Action.KEYS_WRITE) == {"team-a"}
    assert lead.team_scope(Action.CATALOG_READ) is None  # not a team-scoped action
    both = Principal("u3", frozenset({Role.TEAM_ADMIN, Role.OPERATOR}), frozenset({"team-a"}))
    assert both.team_scope(Action.KEYS_READ) is None  # the operator reads every key
    assert both.team_scope(Action.KEYS_WRITE) == {"team-a"}  # but writes its team's only


def _settings(role_map: str, **extra: object) -> object:
    return oidc_settings(issuer="https://idp.example", client_id="llmgw",
                         redirect_url="https://cp.example/console/auth/callback",
                         role_map=role_map, **extra)  # type: ignore[arg-type]


def test_groups_nested_claims_and_email_map_to_roles() -> None:
    settings = oidc_settings(
        issuer="https://idp.example", client_id="llmgw",
        redirect_url="https://cp.example/console/auth/callback",
        roles_claim="realm_access.roles", team_claim="team",
        role_map="ops=operator,leads=team_admin,email:boss@example.test=admin,"
                 "b-leads=team_admin:team-b")
    assert settings is not None
    claims = {"sub": "s", "realm_access": {"roles": ["ops", "leads", "b-leads"]},
              "team": "team-a", "email": "x@example.test"}
    p = principal_from_claims(claims, settings, via="session")
    assert p.roles == {Role.OPERATOR, Role.TEAM_ADMIN} and p.teams == {"team-a", "team-b"}
    assert p.name == "x@example.test"
    boss = principal_from_claims({"sub": "b", "email": "boss@example.test"}, settings, "bearer")
    assert boss.roles == {Role.ADMIN}
    unverified = {"sub": "b", "email": "boss@example.test", "email_verified": False}
    assert not principal_from_claims(unverified, settings, "bearer").roles
    # A team_admin rule with no team in the token grants nothing.
    assert not principal_from_claims({"sub": "s", "realm_access": {"roles": ["leads"]}},
                                     settings, "session").roles


@pytest.mark.parametrize(("flags", "message"), [
    ({"role_map": "ops=superuser"}, "not one of"),
    ({"role_map": "ops"}, "not GROUP=ROLE"),
    ({"role_map": "ops=viewer:team-a"}, "only team_admin takes a team"),
    ({"role_map": ""}, "nobody signing in would have a role"),
    ({"role_map": "leads=team_admin"}, "needs --oidc-team-claim"),
    ({"role_map": "ops=viewer", "audience": "llmgw"}, "must differ"),
])
def test_settings_that_cannot_work_stop_start_up(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _settings(**flags)


def test_plain_http_issuers_only_on_loopback() -> None:
    with pytest.raises(ConfigError, match="must be https"):
        oidc_settings(issuer="http://idp.example", client_id="c",
                      redirect_url="https://cp/cb", role_map="a=admin")
    ok = oidc_settings(issuer="http://127.0.0.1:9000/", client_id="c",
                       redirect_url="http://127.0.0.1:8080/console/auth/callback",
                       role_map="a=admin")
    assert ok is not None and ok.issuer == "http://127.0.0.1:9000" and not ok.secure_cookies
    assert parse_role_map(" a = admin , b=team_admin:t ")[1].team == "t"


def test_no_issuer_no_sso_and_the_secret_comes_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert oidc_settings(issuer=None, client_id=None, redirect_url=None) is None
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    monkeypatch.setenv("LLMGW_OIDC_CLIENT_SECRET", "from-env")
    with_file = _settings("a=admin", secret_file=secret)
    assert with_file.client_secret == "from-file"  # type: ignore[attr-defined]
    assert _settings("a=admin").client_secret == "from-env"  # type: ignore[attr-defined]
    assert "from-env" not in repr(_settings("a=admin"))
