"""API keys and tenants. A key maps to a tenant whose salt goes into every cache key it makes, so
one tenant never hits (and cannot time) another tenant's entries; groups an operator lists in
`shared_groups` use the shared namespace on purpose. Keys are compared in constant time and
never logged.

Behind a proxy: a key listed in `trusted_proxy_keys` belongs to a toolkv proxy, which names the
tenant of each request it forwards in the `X-Toolkv-Tenant` header; that request's namespace is the
named tenant's, scoped under the proxy's key (so a proxy can only name namespaces of its own, never
a direct client's or another proxy's). Without the header a proxy is a tenant of its own. Any other
caller that sends the header (an ordinary key, the admin key, anyone on an open gateway) is refused
with 403 rather than served in the wrong namespace. A body's `cache_salt` names nothing here: no
client picks a namespace."""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import APIError, BadRequest, Unauthorized
from gateway.settings import Settings

TENANT_HEADER = "x-toolkv-tenant"  # the tenant a trusted proxy forwards
_TENANT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Forbidden(APIError):
    status_code = 403
    error_type = "invalid_request_error"
    default_code = "forbidden"


@dataclass(frozen=True, slots=True)
class Tenant:
    salt: str  # "" = the shared namespace (open gateway)
    admin: bool


OPEN = Tenant(salt="", admin=True)


class KeyRing:
    def __init__(self, settings: Settings) -> None:
        self.keys = tuple(k.encode() for k in settings.api_keys)
        self.proxy_keys = tuple(k.encode() for k in settings.trusted_proxy_keys)
        self.admin_key = settings.admin_key.encode() if settings.admin_key else None
        self.shared_groups = frozenset(settings.shared_groups)

    @property
    def open(self) -> bool:
        return not self.keys and not self.proxy_keys and self.admin_key is None

    def tenant(self, request: Request) -> Tenant:
        """The caller's tenant; 401 when keys are configured and none of them was sent, 403 when a
        caller that is not a trusted proxy names a tenant, 400 when a proxy names one badly."""
        named = request.headers.get(TENANT_HEADER)
        tenant = self._caller(request, named is not None)
        if named is None:
            return tenant
        if not _TENANT_NAME.fullmatch(named):
            raise BadRequest(f"the {TENANT_HEADER} header must be 1 to 128 letters, digits or '._:-'",
                             code="invalid_tenant")
        return Tenant(salt=_proxied_salt(tenant.salt, named), admin=False)

    def _caller(self, request: Request, names_tenant: bool) -> Tenant:
        """Who sent the request; when it names a tenant, only a trusted proxy may."""
        if self.open:
            if names_tenant:
                raise _not_a_proxy()
            return OPEN
        sent = _bearer(request)
        if sent is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        if any(hmac.compare_digest(sent, key) for key in self.proxy_keys):
            return Tenant(salt=_salt(sent), admin=False)
        if self.admin_key is not None and hmac.compare_digest(sent, self.admin_key):
            tenant = Tenant(salt=_salt(sent), admin=True)
        elif any(hmac.compare_digest(sent, key) for key in self.keys):
            tenant = Tenant(salt=_salt(sent), admin=False)
        else:
            raise Unauthorized("invalid API key")
        if names_tenant:
            raise _not_a_proxy()
        return tenant

    def admin(self, request: Request) -> Tenant:
        tenant = self.tenant(request)
        if not tenant.admin:
            raise Forbidden("this endpoint needs the admin key")
        return tenant

    def salt_for(self, tenant: Tenant, group_id: str) -> str:
        return "" if group_id in self.shared_groups else tenant.salt


def _bearer(request: Request) -> bytes | None:
    """The key sent as `Authorization: Bearer <key>`, or else as `x-api-key` (Anthropic's way)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        value = request.headers.get("x-api-key", "")
    return value.strip().encode() or None


def _not_a_proxy() -> Forbidden:
    return Forbidden(f"only a trusted proxy may name a tenant in {TENANT_HEADER} (its key must be "
                     "in this server's trusted_proxy_keys)", code="tenant_not_trusted")


def _salt(key: bytes) -> str:
    return hashlib.sha256(b"toolkv-tenant\x00" + key).hexdigest()[:32]


def tenant_salt(key: bytes) -> str:
    """The cache salt of the tenant of API key `key` (what the ingress routes its groups by)."""
    return _salt(key)


def _proxied_salt(proxy_salt: str, named: str) -> str:
    """The namespace of tenant `named` behind the proxy whose own salt is `proxy_salt`: a distinct
    domain from `_salt`, so it never equals a direct key's namespace."""
    return hashlib.sha256(f"toolkv-proxied-tenant\x00{proxy_salt}\x00{named}".encode()).hexdigest()[:32]
