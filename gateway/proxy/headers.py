"""What an upstream gets besides the body: the key it is sent, the tenant it is told, the request id,
and the client's headers that are passed on."""

from __future__ import annotations

from fastapi import Request

from gateway.edge.admission import TENANT_HEADER, Tenant
from gateway.proxy import tenancy
from gateway.proxy.state import proxy_state
from gateway.settings import Settings

BYPASS_HEADER = "x-toolkv-cache"
# passed on as the client sent them: the cache bypass (a toolkv upstream honours it) and the
# Messages API's version headers (an upstream serving Anthropic's API may require them)
PASSED_HEADERS = (BYPASS_HEADER, "anthropic-version", "anthropic-beta")


def upstream_headers(request: Request, tenant: Tenant | None = None) -> dict[str, str]:
    """The upstream key (or, on an open proxy without one, the client's own `Authorization` or
    `x-api-key`: a proxy with keys never passes its clients' keys on), and in tenant mode
    `tenant`'s own salt as `X-Toolkv-Tenant`, which a toolkv upstream that trusts this proxy's key
    takes as the request's namespace (gateway/edge/admission.py)."""
    state = proxy_state(request.app)
    settings: Settings = state.settings
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    safety: tenancy.TenantSafety = state.tenant_safety
    if tenant is not None and tenant.salt and safety.required:
        headers[TENANT_HEADER] = tenant.salt
    # A UUID: llama-cpp-python's server refuses any other X-Request-Id with a bare 400.
    if request_id := getattr(request.state, "upstream_request_id", None):
        headers["x-request-id"] = request_id
    if settings.upstream_api_key:
        headers["authorization"] = f"Bearer {settings.upstream_api_key}"
    elif state.keyring.open and "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    elif state.keyring.open and "x-api-key" in request.headers:  # how Anthropic's clients send a key
        headers["x-api-key"] = request.headers["x-api-key"]
    for name in PASSED_HEADERS:
        if value := request.headers.get(name):
            headers[name] = value
    return headers
