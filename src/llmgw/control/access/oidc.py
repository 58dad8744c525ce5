"""The relying party: discovery, the authorization code flow with PKCE, and token checks.

Signatures are checked with PyJWT against the provider's published keys
(JWKS), and nothing in a token is believed before that: the issuer must be
the configured one exactly, the audience this client (or, for bearer access
tokens, the configured API audience), the token unexpired, and an ID token
must carry the nonce of the login it answers. Only asymmetric algorithms
are accepted, so a token "signed" with ``none`` or with a shared secret an
attacker can choose is refused before any key is looked at.

The provider's keys are fetched once and again when a token names a key id
not yet seen (the provider rotated), at most once a minute, so a flood of
forged key ids cannot turn the control plane into a load on the provider.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import jwt

from llmgw.control.access.settings import OidcSettings
from llmgw.errors import AuthError, ConfigError

ASYMMETRIC = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                        "ES256", "ES384", "ES512", "EdDSA"})
# Clocks of the provider and of this machine disagree by a little.
LEEWAY_S = 30
# A key id not in the cached set triggers a refetch no more often than this.
JWKS_REFETCH_S = 60.0
# Discovery documents change rarely; an hour keeps a long-running control
# plane in step with a provider's new endpoints without asking per login.
METADATA_TTL_S = 3600.0
HTTP_TIMEOUT_S = 10.0


def pkce_challenge(verifier: str) -> str:
    """S256 (RFC 7636): the challenge sent up front, the verifier only with the code."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class LoginRequest:
    """What a login must remember until its callback: never sent to the browser but ``state``."""

    url: str
    state: str
    nonce: str
    verifier: str


class OidcClient:
    """One provider, with its discovery document and keys cached."""

    def __init__(self, settings: OidcSettings, http: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        verify: Any = str(settings.ca_file) if settings.ca_file else True
        self._http = http or httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, verify=verify,
                                               follow_redirects=False)
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = 0.0
        self._keys: jwt.PyJWKSet | None = None
        self._keys_at = 0.0

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            answer = await self._http.get(url, headers={"Accept": "application/json"})
            answer.raise_for_status()
            body = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise AuthError(f"the identity provider did not answer {url}: {exc}") from None
        if not isinstance(body, dict):
            raise AuthError(f"the identity provider's {url} is not a JSON object")
        return body

    async def metadata(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._metadata is not None and now - self._metadata_at < METADATA_TTL_S:
            return self._metadata
        doc = await self._get_json(self.settings.issuer + "/.well-known/openid-configuration")
        # OpenID Connect Discovery 4.3: the document must name the issuer it
        # was fetched for, or a provider could speak for another.
        if doc.get("issuer") != self.settings.issuer:
            raise ConfigError(f"the provider's discovery document names issuer "
                              f"{doc.get('issuer')!r}, not {self.settings.issuer!r}")
        for needed in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            if not isinstance(doc.get(needed), str):
                raise ConfigError(f"the provider's discovery document has no {needed}")
        self._metadata, self._metadata_at = doc, now
        return doc

    async def login_request(self) -> LoginRequest:
        meta = await self.metadata()
        state, nonce = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        verifier = secrets.token_urlsafe(64)
        query = urlencode({
            "response_type": "code",
            "client_id": self.settings.client_id,
            "redirect_uri": self.settings.redirect_url,
            "scope": " ".join(self.settings.scopes),
            "state": state,
            "nonce": nonce,
            "code_challenge": pkce_challenge(verifier),
            "code_challenge_method": "S256",
        })
        endpoint = meta["authorization_endpoint"]
        sep = "&" if "?" in endpoint else "?"
        return LoginRequest(f"{endpoint}{sep}{query}", state, nonce, verifier)

    async def redeem(self, code: str, login: LoginRequest) -> dict[str, Any]:
        """The code for tokens, then the ID token's claims once verified (nonce included)."""
        meta = await self.metadata()
        form = {"grant_type": "authorization_code", "code": code,
                "redirect_uri": self.settings.redirect_url, "code_verifier": login.verifier,
                "client_id": self.settings.client_id}
        # client_secret_basic for a confidential client; a public one proves
        # itself with the PKCE verifier alone.
        secret = self.settings.client_secret
        auth: dict[str, Any] = (
            {"auth": httpx.BasicAuth(self.settings.client_id, secret)} if secret else {})
        try:
            answer = await self._http.post(meta["token_endpoint"], data=form, **auth,
                                           headers={"Accept": "application/json"})
            body = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise AuthError(f"the identity provider's token endpoint failed: {exc}") from None
        if answer.status_code != 200 or not isinstance(body, dict):
            why = body.get("error_description") or body.get("error") if isinstance(
                body, dict) else None
            raise AuthError(f"the identity provider refused the code ({answer.status_code}"
                            f"{': ' + str(why) if why else ''})")
        id_token = body.get("id_token")
        if not isinstance(id_token, str):
            raise AuthError("the identity provider answered without an ID token")
        claims = await self.verify(id_token, audience=self.settings.client_id)
        if not secrets.compare_digest(str(claims.get("nonce", "")), login.nonce):
            raise AuthError("the ID token does not answer this login (nonce mismatch)")
        azp = claims.get("azp")
        if isinstance(claims.get("aud"), list) and len(claims["aud"]) > 1 and \
                azp != self.settings.client_id:
            raise AuthError("the ID token was issued to another client (azp)")
        return claims

    async def verify_access_token(self, token: str) -> dict[str, Any]:
        """A provider's JWT access token meant for this API (``--oidc-audience``)."""
        if not self.settings.audience:
            raise AuthError("this control plane takes no identity provider tokens "
                            "(no --oidc-audience); use the admin token or sign in")
        return await self.verify(token, audience=self.settings.audience)

    async def verify(self, token: str, *, audience: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthError(f"not a signed token: {exc}") from None
        alg = header.get("alg")
        if alg not in ASYMMETRIC:
            raise AuthError(f"token algorithm {alg!r} is not accepted")
        key = await self._key(header.get("kid"), alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=[alg], audience=audience,
                issuer=self.settings.issuer, leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise AuthError(f"token refused: {exc}") from None
        return claims

    async def _key(self, kid: Any, alg: str) -> jwt.PyJWK:
        now = time.monotonic()
        if self._keys is None or (self._find(kid, alg) is None
                                  and now - self._keys_at >= JWKS_REFETCH_S):
            meta = await self.metadata()
            try:
                self._keys = jwt.PyJWKSet.from_dict(await self._get_json(meta["jwks_uri"]))
            except jwt.PyJWTError as exc:
                raise AuthError(f"the identity provider's keys are unusable: {exc}") from None
            self._keys_at = now
        key = self._find(kid, alg)
        if key is None:
            raise AuthError(f"the token's key {kid!r} is not one of the provider's")
        return key

    def _find(self, kid: Any, alg: str) -> jwt.PyJWK | None:
        keys = self._keys.keys if self._keys is not None else []
        for key in keys:
            if (kid is None or key.key_id == kid) and _fits(key, alg):
                return key
        return None


_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


def _fits(key: jwt.PyJWK, alg: str) -> bool:
    """A signing key of the token algorithm's type: no algorithm confusion across key types."""
    return key.key_type == _KEY_TYPES.get(alg[:2]) and key.public_key_use in (None, "sig")
