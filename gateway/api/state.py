"""What the model app owns, typed: one `GatewayState`, built with the app (`create_app`) and read
through `gateway_state`, so that every read is checked (Starlette's lifespan state, typed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.applications import Starlette

from gateway.api.responses.store import ResponseStore
from gateway.api.threads import ThreadStore
from gateway.edge.admission import KeyRing, Preparer, TenantQuota
from gateway.errors import ModelLoadFailed, ModelLoading
from gateway.metrics import Metrics
from gateway.settings import Settings

if TYPE_CHECKING:  # the dashboard's module and the fleet view's import this one without torch
    from gateway.api.dashboard import TtftWindows
    from gateway.kvcache.store import EntryInfo
    from gateway.serving.runtime import Runtime


@dataclass(slots=True)
class ModelSlot:
    """The app's model: empty while it loads, then its runtime or the load's error (each set once,
    by the loader thread)."""

    runtime: Runtime | None = None
    load_error: str | None = None

    def loaded(self) -> Runtime:
        """The runtime, or 503 (with Retry-After while the model loads) when there is none yet."""
        if self.runtime is not None:
            return self.runtime
        if self.load_error:
            raise ModelLoadFailed(f"the model failed to load: {self.load_error}")
        raise ModelLoading("the model is still loading; retry shortly", headers={"Retry-After": "5"})

    @property
    def status(self) -> str:
        """`ok`, `loading` or `failed`, as /health says."""
        return "ok" if self.runtime is not None else ("failed" if self.load_error else "loading")


@dataclass(frozen=True, slots=True)
class GatewayState:
    settings: Settings
    metrics: Metrics
    keyring: KeyRing
    quota: TenantQuota
    preparer: Preparer
    model: ModelSlot  # the runtime once the loader thread has it
    responses: ResponseStore  # `previous_response_id` and the Responses GET routes
    threads: ThreadStore  # Messages threads
    ttft_windows: TtftWindows  # the dashboard's TTFT chart
    started_at: int  # unix seconds: the models' `created`
    dashboard_pinned: dict[str, EntryInfo | None] = field(default_factory=dict)  # pinned groups found on disk


def gateway_state(app: Starlette) -> GatewayState:
    state = app.state.gateway
    if not isinstance(state, GatewayState):
        raise TypeError(f"not a model app's state: {type(state).__name__}")
    return state
