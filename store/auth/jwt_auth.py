"""A JWT as the credential: the MQTT password, or the Kafka SASL/OAUTHBEARER token.

PyJWT does the signature and claim work (`jwt.decode`, `PyJWK`, `PyJWKSet`); this module picks the
key, maps the claims and keeps the key set fresh. Keys come from a secret file (HS256), a public
key or JWKS file (RS256, ES256), or a JWKS URL. A URL is fetched with aiohttp on the event loop
(PyJWKClient's own fetch is a blocking urllib call), every `jwks_refresh_s` and again when a token
names a `kid` the set lacks, at most once per `jwks_min_interval_s` (a client inventing kids
cannot make the gateway hammer the identity provider). Verification itself is a few tens of
microseconds of CPU and runs inline.

Claims: `username_claim` (default `sub`) is the user name; `acl_claim` (default `acl`), when
present, is the client's rights, in EMQX's shape `{"pub": [...], "sub": [...], "all": [...]}`
of topic filters with `%u` / `%c` substituted as in an acl_file `pattern` line (the same
compiler, `store.auth.acl`). A token without the ACL claim gets the acl_file's rules for its
user. `exp` is required unless `require_exp` is off; `nbf` is always checked when present;
`iss` and `aud` when configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from jwt import PyJWK, PyJWKSet

from store.auth.acl import READ, WRITE, Acl, ClientAcl, Rule, valid_filter
from store.auth.errors import AuthFileError

log = logging.getLogger("lightgate.auth")

_ACL_KEYS = {"pub": WRITE, "sub": READ, "all": READ | WRITE}
_KEY_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "RSA": ("RS256",),
    "EC": ("ES256",),
    "oct": ("HS256",),
}


class JwtRefused(Exception):
    """The token is not accepted; the message says why (logged, never sent to the client)."""


@dataclass(frozen=True, slots=True)
class JwtSettings:
    secret_file: str = ""
    key_file: str = ""
    jwks_url: str = ""
    jwks_refresh_s: float = 300.0
    jwks_min_interval_s: float = 10.0
    fetch_timeout_s: float = 5.0
    algorithms: tuple[str, ...] = ("HS256", "RS256", "ES256")
    username_claim: str = "sub"
    acl_claim: str = "acl"
    issuer: str = ""
    audience: str = ""
    leeway_s: int = 0
    require_exp: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.secret_file or self.key_file or self.jwks_url)


@dataclass(frozen=True, slots=True)
class Grant:
    """What an accepted token proves: the user, its rights (None: the acl_file's), its end."""

    user: str | None
    acl: ClientAcl | None
    expires_at: float | None  # Unix seconds; None: the token has no `exp`


def looks_like_jwt(password: bytes | str | None) -> bool:
    """A compact JWS (`header.payload.signature`, JSON header starting `{"` = `eyJ`)."""
    if password is None:
        return False
    text = password if isinstance(password, str) else password[:3].decode("latin-1")
    if not text.startswith("eyJ"):
        return False
    whole = password if isinstance(password, str) else password.decode("latin-1")
    return whole.count(".") == 2


class JwtAuth:
    """The current keys and the claim rules; `verify` for a token, `reload` on SIGHUP."""

    def __init__(self, settings: JwtSettings, file_keys: list[PyJWK]) -> None:
        self.settings = settings
        self._file_keys = file_keys  # from secret_file / key_file (reloaded on SIGHUP)
        self._url_keys: dict[str, PyJWK] = {}  # kid -> key, from jwks_url
        self._url_unkeyed: list[PyJWK] = []  # JWKS entries without a kid
        self._fetched_at = -1e18  # monotonic time of the last fetch attempt
        self._fetch: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self.fetches = 0
        self.fetch_failures = 0

    @classmethod
    def load(cls, settings: JwtSettings) -> JwtAuth:
        return cls(settings, _read_key_files(settings))

    def reload(self) -> None:
        """Re-read the key files (AuthFileError leaves the old keys in place)."""
        self._file_keys = _read_key_files(self.settings)

    # -- verification ----------------------------------------------------------------------
    def verify(self, token: str, client_id: str, *, now: float | None = None) -> Grant:
        """Check `token` with the keys at hand; JwtRefused, or KeyError(kid) for a kid to fetch."""
        s = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise JwtRefused(f"not a JWT: {exc}") from None
        alg = header.get("alg")
        if alg not in s.algorithms:
            raise JwtRefused(f"algorithm {alg!r} not accepted")
        candidates = self._keys_for(header.get("kid"), alg)
        options: dict[str, Any] = {"verify_aud": bool(s.audience)}
        if s.require_exp:
            options["require"] = ["exp"]
        last: Exception | None = None
        for key in candidates:
            try:
                claims = jwt.decode(
                    token,
                    key.key,
                    algorithms=[alg],
                    audience=s.audience or None,
                    issuer=s.issuer or None,
                    leeway=s.leeway_s,
                    options=options,  # type: ignore[arg-type]
                )
            except jwt.InvalidSignatureError as exc:
                last = exc  # another key of the same kind may fit
                continue
            except jwt.PyJWTError as exc:
                raise JwtRefused(f"{type(exc).__name__}: {exc}") from None
            return self._grant(claims, client_id)
        raise JwtRefused(f"signature not verified by any key: {last}" if last else "no key")

    async def verify_async(self, token: str, client_id: str) -> Grant:
        """`verify`, fetching the JWKS first when it names an unknown kid (rate-limited)."""
        self._start_refresher()
        try:
            return self.verify(token, client_id)
        except KeyError as exc:
            kid = exc.args[0]
        if time.monotonic() - self._fetched_at >= self.settings.jwks_min_interval_s:
            await self.refresh()
        try:
            return self.verify(token, client_id)
        except KeyError:
            raise JwtRefused(f"unknown key id {kid!r}") from None

    def _keys_for(self, kid: Any, alg: str) -> list[PyJWK]:
        """The keys that may have signed a token: the one its `kid` names, else keys that have
        no kid (a PEM file, the secret); a kid naming no key is fetched for when a URL is set."""
        if kid is not None and self.settings.jwks_url:
            key = self._url_keys.get(str(kid))
            if key is not None:
                return [key] if alg in _algorithms(key) else []
        unkeyed = [k for k in self._file_keys + self._url_unkeyed if not k.key_id]
        if kid is None:
            pool = unkeyed + [k for k in self._file_keys if k.key_id]
        else:
            named = [k for k in self._file_keys if k.key_id == str(kid)]
            if not named and self.settings.jwks_url:
                raise KeyError(str(kid))
            pool = named + unkeyed
        return [k for k in pool if alg in _algorithms(k)]

    def _grant(self, claims: dict[str, Any], client_id: str) -> Grant:
        s = self.settings
        user = claims.get(s.username_claim)
        if user is not None and not isinstance(user, str):
            raise JwtRefused(f"claim {s.username_claim!r} is not a string")
        rules = claims.get(s.acl_claim)
        acl = None if rules is None else client_acl(rules, user, client_id)
        exp = claims.get("exp")
        return Grant(user, acl, float(exp) if isinstance(exp, int | float) else None)

    # -- the key set of jwks_url -----------------------------------------------------------
    def _start_refresher(self) -> None:
        if self.settings.jwks_url and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.jwks_refresh_s)

    async def refresh(self) -> None:
        """Fetch the JWKS once; callers arriving meanwhile wait for the same fetch."""
        if self._fetch is None or self._fetch.done():
            self._fetch = asyncio.get_running_loop().create_task(self._fetch_jwks())
        await asyncio.shield(self._fetch)

    async def _fetch_jwks(self) -> None:
        import aiohttp

        self._fetched_at = time.monotonic()
        self.fetches += 1
        url = self.settings.jwks_url
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.fetch_timeout_s)
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.get(url) as resp,
            ):
                resp.raise_for_status()
                data = await resp.json(content_type=None)
            keys = PyJWKSet.from_dict(data).keys
        except Exception as exc:  # network, HTTP, JSON or JWKS errors: keep the old keys
            self.fetch_failures += 1
            log.warning("JWKS fetch from %s failed, the previous keys stay: %s", url, exc)
            return
        self._url_keys = {k.key_id: k for k in keys if k.key_id}
        self._url_unkeyed = [k for k in keys if not k.key_id]
        log.info("JWKS fetched", extra={"url": url, "keys": len(keys)})

    def close(self) -> None:
        for task in (self._refresher, self._fetch):
            if task is not None:
                task.cancel()


def client_acl(rules: Any, user: str | None, client_id: str) -> ClientAcl:
    """The ACL claim `{"pub": [...], "sub": [...], "all": [...]}` compiled for one client."""
    if not isinstance(rules, dict):
        raise JwtRefused("the ACL claim is not an object of pub/sub/all lists")
    patterns: list[Rule] = []
    for name, filters in rules.items():
        access = _ACL_KEYS.get(name)
        if access is None:
            raise JwtRefused(f"ACL claim: unknown key {name!r} (pub, sub or all)")
        if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
            raise JwtRefused(f"ACL claim: {name!r} is not a list of topic filters")
        for filt in filters:
            if not valid_filter(filt.replace("%u", "u").replace("%c", "c")):
                raise JwtRefused(f"ACL claim: invalid topic filter {filt!r}")
            patterns.append(Rule(access, filt, 0, pattern=True))
    return Acl(patterns=patterns).for_client(user, client_id)


def _algorithms(key: PyJWK) -> tuple[str, ...]:
    name = getattr(key, "algorithm_name", None)
    if name and name != "none":
        return (name,)
    return _KEY_ALGORITHMS.get(key.key_type or "", ())


def _read_key_files(s: JwtSettings) -> list[PyJWK]:
    keys: list[PyJWK] = []
    if s.secret_file:
        try:
            secret = Path(s.secret_file).read_bytes().strip()
        except OSError as exc:
            raise AuthFileError(s.secret_file, 0, f"cannot read: {exc}") from None
        if len(secret) < 32:
            raise AuthFileError(s.secret_file, 0, "an HS256 secret needs at least 32 bytes")
        keys.append(PyJWK({"kty": "oct", "k": _b64url(secret)}, "HS256"))
    if s.key_file:
        keys += _read_public_keys(s.key_file)
    return keys


def _read_public_keys(path: str) -> list[PyJWK]:
    """A PEM public key (RSA or P-256) or a JWKS document (`{"keys": [...]}`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthFileError(path, 0, f"cannot read: {exc}") from None
    try:
        if text.lstrip().startswith("{"):
            return list(PyJWKSet.from_dict(json.loads(text)).keys)
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        public = load_pem_public_key(text.encode())
        if isinstance(public, rsa.RSAPublicKey):
            jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(public))
            return [PyJWK(jwk, "RS256")]
        if isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1":
            jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(public))
            return [PyJWK(jwk, "ES256")]
        raise ValueError("not an RSA or P-256 public key")
    except (ValueError, jwt.PyJWTError) as exc:
        raise AuthFileError(path, 0, f"not a PEM public key or JWKS: {exc}") from None


def _b64url(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
