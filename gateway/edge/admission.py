"""Admission: who a request is (its API key and tenant) and what it passes before it reaches the
engine, and holds while it runs (a turn on the prepare threads, one of its key's quota slots).

Keys and tenants (`KeyRing`, `Tenant`). A key maps to a tenant whose salt goes into every cache
key it makes, so one tenant never hits (and cannot time) another tenant's entries; groups an
operator lists in `shared_groups` use the shared namespace on purpose. Keys are compared in
constant time and never logged.

Behind a proxy: a key listed in `trusted_proxy_keys` belongs to a toolkv proxy, which names the
tenant of each request it forwards in the `X-Toolkv-Tenant` header; that request's namespace is the
named tenant's, scoped under the proxy's key (so a proxy can only name namespaces of its own, never
a direct client's or another proxy's). Without the header a proxy is a tenant of its own. Any other
caller that sends the header (an ordinary key, the admin key, anyone on an open gateway) is refused
with 403 rather than served in the wrong namespace. A body's `cache_salt` names nothing here: no
client picks a namespace.

What a chat request passes before it reaches the engine, and what it holds while it runs:
- `Preparer`: parsing, validating, rendering and tokenizing run on a small pool of worker
  threads, never on the event loop (a 4 MB prompt takes the loop's time from `/health` and from
  every other stream otherwise). The pool is bounded: past `max_pending` requests waiting for it,
  a request gets 429. It is fair between tenants: each tenant has its own FIFO queue, and a free
  worker takes the next job of the waiting tenant with the fewest prepares running (ties: the one
  served longest ago), so one key's backlog of expensive prepares delays another key's request by
  at most one of its running prepares, not by the whole backlog.
- `TenantQuota`: each API key may have at most `limit` chat requests queued or running, so one
  key cannot fill the engine's queue and starve the others (429 + `Retry-After`). The open
  gateway (no keys) has one tenant and only the engine's global queue bound.
- `disconnected`: resolves when the client hangs up, so a non-streaming request can be cancelled
  like a stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from gateway.errors import APIError, BadRequest, Overloaded, ShuttingDown, Unauthorized
from gateway.settings import Settings

TENANT_HEADER = "x-toolkv-tenant"  # the tenant a trusted proxy forwards
_TENANT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
T = TypeVar("T")

PREPARE_WORKERS = 2
RETRY_AFTER = {"Retry-After": "1"}


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


class Preparer:
    def __init__(self, max_pending: int, workers: int = PREPARE_WORKERS) -> None:
        self.max_pending = max_pending
        self._pending = 0  # only touched on the event loop
        self._lock = threading.Condition()
        self._queues: dict[str, deque[_Job]] = {}  # tenant -> its jobs not yet started, oldest first
        self._order: deque[str] = deque()  # tenants with queued jobs, served longest ago first
        self._running: Counter[str] = Counter()  # tenant -> its jobs on a worker now
        self._closed = False
        self._workers = workers
        self._threads: list[threading.Thread] = []  # started with the first job

    async def run(self, fn: Callable[[], T], tenant: str = "") -> T:
        """`fn()` on a prepare thread, in `tenant`'s turn; a cancelled caller's job never starts."""
        if self._pending >= self.max_pending:
            raise Overloaded("the server is busy: too many requests are being prepared; retry shortly",
                             headers=RETRY_AFTER)
        job = _Job(fn, tenant)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down; retry on another instance")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
                self._order.append(tenant)
            queue.append(job)
            self._lock.notify()
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"toolkv-prepare_{i}", daemon=True)
                                 for i in range(self._workers)]
                for thread in self._threads:
                    thread.start()
        self._pending += 1
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            if job.future.cancel():  # not started yet: it never will be
                self._drop(job)
            raise
        finally:
            self._pending -= 1

    def waiting(self, tenant: str = "") -> int:
        """How many of `tenant`'s jobs wait for a worker (not counting the running ones)."""
        with self._lock:
            return len(self._queues.get(tenant, ()))

    def running(self, tenant: str = "") -> int:
        with self._lock:
            return self._running[tenant]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._order.clear()
            self._lock.notify_all()

    def _next(self) -> _Job | None:
        """The next job to run (under the lock): the oldest of the waiting tenant with the fewest
        jobs running, the longest-unserved tenant first among equals; None once closed."""
        while not self._order:
            if self._closed:
                return None
            self._lock.wait()
        tenant = min(self._order, key=self._running.__getitem__)  # min keeps the first of equals
        self._order.remove(tenant)
        queue = self._queues[tenant]
        job = queue.popleft()
        if queue:
            self._order.append(tenant)
        else:
            del self._queues[tenant]
        self._running[tenant] += 1
        return job

    def _work(self) -> None:
        while True:
            with self._lock:
                job = self._next()
            if job is None:
                return
            try:
                job.execute()
            finally:
                with self._lock:
                    self._running[job.tenant] -= 1
                    if self._running[job.tenant] <= 0:
                        del self._running[job.tenant]

    def _drop(self, job: _Job) -> None:
        """Forget a cancelled job still in its queue (its body is not kept until a worker skips it)."""
        with self._lock:
            queue = self._queues.get(job.tenant)
            if queue is None or job not in queue:
                return
            queue.remove(job)
            if not queue:
                del self._queues[job.tenant]
                self._order.remove(job.tenant)


class _Job:
    __slots__ = ("fn", "future", "tenant")

    def __init__(self, fn: Callable[[], Any], tenant: str) -> None:
        self.fn = fn
        self.tenant = tenant
        self.future: Future[Any] = Future()

    def execute(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its caller went away while it waited
        try:
            result = self.fn()
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)
        finally:
            self.fn = _spent  # nothing the request held stays reachable from the finished job


def _spent() -> None:
    return None


class TenantQuota:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> Callable[[], None]:
        """Take one of `tenant`'s slots; the returned callable gives it back (once)."""
        with self._lock:
            if self._held[tenant] >= self.limit:
                raise Overloaded(f"this API key already has {self.limit} requests queued or running; "
                                 "retry when one finishes", code="too_many_requests_for_key",
                                 headers=RETRY_AFTER)
            self._held[tenant] += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._held[tenant] -= 1
                    if self._held[tenant] <= 0:
                        del self._held[tenant]

        return release

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held[tenant]


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (after the body was read, the server's next message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
