"""API keys and tenants. A key maps to a tenant whose salt goes into every cache key it makes, so
one tenant never hits (and cannot time) another tenant's entries; groups an operator lists in
`shared_groups` use the shared namespace on purpose. Keys are compared in constant time and
never logged."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import APIError, Unauthorized
from gateway.settings import Settings


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
        self.admin_key = settings.admin_key.encode() if settings.admin_key else None
        self.shared_groups = frozenset(settings.shared_groups)

    @property
    def open(self) -> bool:
        return not self.keys and self.admin_key is None

    def tenant(self, request: Request) -> Tenant:
        """The caller's tenant; 401 when keys are configured and none of them was sent."""
        if self.open:
            return OPEN
        sent = _bearer(request)
        if sent is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if self.admin_key is not None and hmac.compare_digest(sent, self.admin_key):
            return Tenant(salt=_salt(sent), admin=True)
        if any(hmac.compare_digest(sent, key) for key in self.keys):
            return Tenant(salt=_salt(sent), admin=False)
        raise Unauthorized("invalid API key")

    def admin(self, request: Request) -> Tenant:
        tenant = self.tenant(request)
        if not tenant.admin:
            raise Forbidden("this endpoint needs the admin key")
        return tenant

    def salt_for(self, tenant: Tenant, group_id: str) -> str:
        return "" if group_id in self.shared_groups else tenant.salt


def _bearer(request: Request) -> bytes | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip().encode()


def _salt(key: bytes) -> str:
    return hashlib.sha256(b"toolkv-tenant\x00" + key).hexdigest()[:32]
