from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.engine import Finished, Prefilled, TextDelta
from gateway.engine.sampling import TokenLogprob
from gateway.metrics import Metrics
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import load_settings
from tests.support.tiny_gguf import write_tiny_gguf


def make_runtime(model_dir: Path, **overrides: Any) -> Runtime:
    if "cache_dir" not in overrides:
        overrides["disk_budget_bytes"] = 0  # RAM only, and nothing written to the user's cache dir
    settings = load_settings(overrides={"model": str(model_dir), "min_prefix_tokens": 8, **overrides},
                             environ={})
    return build_runtime(settings, Metrics())


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Read only by the tests (a loader that converts it writes into its own cache dir)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.Q8_0.gguf")


@pytest.fixture
def runtime_for(tiny_model_dir: Callable[..., Path]) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(arch: str = "llama", seed: int = 0, context: int = 4096, **overrides: Any) -> Runtime:
        runtime = make_runtime(tiny_model_dir(arch, seed, context), **overrides)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.engine.stop()


class Run:
    def __init__(self, prefilled: Prefilled, finished: Finished, text: str,
                 logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.prefilled = prefilled
        self.finished = finished
        self.text = text
        self.logprobs = logprobs


def generate(runtime: Runtime, body: dict[str, Any], bypass: bool = False, tenant: str = "",
             shared: bool = False) -> Run:
    """Run one request through the service and engine, collecting the raw events. `tenant`: the
    tenant's salt (its groups' too, unless `shared`)."""
    prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(body), bypass=bypass,
                                       salt_for=lambda _: "" if shared else tenant, tenant=tenant)

    async def collect() -> Run:
        pre, fin, parts, logprobs = None, None, [], []
        async for event in runtime.service.events(prepared):
            if isinstance(event, Prefilled):
                pre = event
            elif isinstance(event, TextDelta):
                parts.append(event.text)
                logprobs += event.logprobs
            elif isinstance(event, Finished):
                fin = event
        assert pre is not None and fin is not None
        return Run(pre, fin, "".join(parts), tuple(logprobs))

    return asyncio.run(collect())


def not_kept(runtime: Runtime) -> int:
    """Pool blocks in use other than conversation records (kept for a next turn, dropped on demand)."""
    return runtime.engine.pool.num_used - runtime.engine.cache.conversations.num_blocks
