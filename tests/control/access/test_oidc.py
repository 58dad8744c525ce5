"""The relying party's checks, each against a token a small provider on loopback made wrong.

The real provider (tests/console/test_sso.py) makes only good tokens; here
each claim the client must check is broken on purpose, one at a time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tests.servers import serve_asgi

from llmgw.control.access import oidc
from llmgw.control.access.oidc import OidcClient
from llmgw.control.access.settings import OidcSettings
from llmgw.errors import AuthError, ConfigError


@dataclass
class FakeProvider:
    issuer: str = ""
    keys: dict[str, rsa.RSAPrivateKey] = field(default_factory=dict)
    claimed_issuer: str | None = None  # what discovery says, when not the truth
    id_token: str = ""
    jwks_fetches: int = 0

    def add_key(self, kid: str) -> None:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def sign(self, kid: str = "k1", alg: str = "RS256", **overrides: Any) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": "llmgw", "sub": "u1", "iat": now,
                  "exp": now + 300, **overrides}
        return jwt.encode({k: v for k, v in claims.items() if v is not None},
                          self.keys[kid], algorithm=alg, headers={"kid": kid})

    def app(self) -> Starlette:
        async def discovery(_: Request) -> JSONResponse:
            return JSONResponse({
                "issuer": self.claimed_issuer or self.issuer,
                "authorization_endpoint": f"{self.issuer}/auth",
                "token_endpoint": f"{self.issuer}/token",
                "jwks_uri": f"{self.issuer}/jwks",
            })

        async def jwks(_: Request) -> JSONResponse:
            self.jwks_fetches += 1
            keys = []
            for kid, key in self.keys.items():
                public = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
                keys.append({**public, "kid": kid, "use": "sig"})
            return JSONResponse({"keys": keys})

        async def token(_: Request) -> JSONResponse:
            return JSONResponse({"id_token": self.id_token, "token_type": "Bearer",
                                 "access_token": "opaque"})

        return Starlette(routes=[
            Route("/.well-known/openid-configuration", discovery),
            Route("/jwks", jwks), Route("/token", token, methods=["POST"]),
        ])


@pytest_asyncio.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider()
    fake.add_key("k1")
    async with serve_asgi(fake.app()) as url:
        fake.issuer = url
        yield fake


def client_of(provider: FakeProvider, audience: str | None = "api") -> OidcClient:
    return OidcClient(OidcSettings(issuer=provider.issuer, client_id="llmgw",
                                   redirect_url="http://127.0.0.1:1/cb", audience=audience))


async def test_a_good_token_passes_and_each_broken_claim_is_refused(
    provider: FakeProvider,
) -> None:
    client = client_of(provider)
    try:
        assert (await client.verify(provider.sign(), audience="llmgw"))["sub"] == "u1"
        broken = {
            "expired": provider.sign(exp=int(time.time()) - 120),
            "audience": provider.sign(aud="someone-else"),
            "issuer": provider.sign(iss="https://evil.example"),
            "no subject": provider.sign(sub=None),
        }
        for what, token in broken.items():
            with pytest.raises(AuthError):
                await client.verify(token, audience="llmgw")
                pytest.fail(f"a token with a bad {what} passed")
        unsigned = jwt.encode({"iss": provider.issuer, "aud": "llmgw", "sub": "u1"}, None,
                              algorithm="none")
        with pytest.raises(AuthError, match="'none' is not accepted"):
            await client.verify(unsigned, audience="llmgw")
        # An ID token (audience: the client) is no access token for the API.
        with pytest.raises(AuthError, match="Audience"):
            await client.verify_access_token(provider.sign())
        assert (await client.verify_access_token(provider.sign(aud="api")))["aud"] == "api"
    finally:
        await client.aclose()


async def test_a_rotated_key_is_fetched_once_and_unknown_ones_do_not_flood_the_provider(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_of(provider)
    try:
        await client.verify(provider.sign(), audience="llmgw")
        assert provider.jwks_fetches == 1
        provider.add_key("k2")
        # Within the refetch pause a new key id is not looked for...
        with pytest.raises(AuthError, match="not one of the provider's"):
            await client.verify(provider.sign("k2"), audience="llmgw")
        assert provider.jwks_fetches == 1
        # ... after it, once.
        monkeypatch.setattr(oidc, "JWKS_REFETCH_S", 0.0)
        await client.verify(provider.sign("k2"), audience="llmgw")
        assert provider.jwks_fetches == 2
    finally:
        await client.aclose()


async def test_discovery_must_name_the_issuer_and_the_id_token_the_nonce(
    provider: FakeProvider,
) -> None:
    client = client_of(provider)
    try:
        login = await client.login_request()
        assert "code_challenge_method=S256" in login.url and login.state in login.url
        assert login.verifier not in login.url  # only its hash travels up front
        provider.id_token = provider.sign(nonce="another-login")
        with pytest.raises(AuthError, match="nonce"):
            await client.redeem("code", login)
        provider.id_token = provider.sign(nonce=login.nonce)
        assert (await client.redeem("code", login))["sub"] == "u1"
    finally:
        await client.aclose()
    provider.claimed_issuer = "https://elsewhere.example"
    liar = client_of(provider)
    try:
        with pytest.raises(ConfigError, match="names issuer"):
            await liar.metadata()
    finally:
        await liar.aclose()
