"""Continuous batching: many requests at once give each the tokens it gets alone, and the step
loop keeps serving while a long tool group compiles."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.engine import Failed, Finished, Prefilled, TextDelta
from gateway.errors import Overloaded
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime
from tests.engine.conftest import Run, generate, not_kept

ARCHS = ["llama", "qwen2", "mistral"]
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x float32
QUESTIONS = ["What was GMV last week?", "Refunds?", "List every product whose stock fell under ten units " * 3,
             "Top sellers?", "hi", "Compare this month's orders with last month's, by channel and by region.",
             "Stock of item 7?", "Which customers returned more than two orders " * 5]


def body(tools: list[dict[str, Any]], question: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": question}],
            "tools": tools, "temperature": 0, "max_tokens": max_tokens, **extra}


async def _run(runtime: Runtime, request: dict[str, Any], bypass: bool = False,
               order: list[tuple[str, str]] | None = None, label: str = "") -> Run:
    prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request), bypass=bypass)
    pre, fin, parts = None, None, []
    async for event in runtime.service.events(prepared):
        if isinstance(event, Prefilled):
            pre = event
            if order is not None:
                order.append((label, "prefilled"))
        elif isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            fin = event
            if order is not None:
                order.append((label, "finished"))
    assert pre is not None and fin is not None
    return Run(pre, fin, "".join(parts))


def run_together(runtime: Runtime, requests: list[tuple[dict[str, Any], bool]]) -> list[Run]:
    async def main() -> list[Run]:
        return list(await asyncio.gather(*(_run(runtime, r, bypass) for r, bypass in requests)))
    return asyncio.run(main())


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_requests_at_once_give_the_tokens_each_gives_alone(runtime_for, merchant_tools, arch):
    """Different lengths, hits, a miss of another group, bypasses and a request with no tools,
    all batched: every one's greedy tokens equal its run alone (and its bypass run alone)."""
    runtime = runtime_for(arch)
    cached, other = merchant_tools[:5], merchant_tools[5:9]
    generate(runtime, body(cached, "warm", max_tokens=1))
    requests = [(body(cached, q, max_tokens=8 + 2 * i), i % 3 == 2) for i, q in enumerate(QUESTIONS[:6])]
    requests.append((body(other, QUESTIONS[6]), False))  # a miss, compiled while the others decode
    requests.append(({"messages": [{"role": "user", "content": QUESTIONS[7]}], "temperature": 0,
                      "max_tokens": 10}, False))
    runtime.engine.drain_steps()
    together = run_together(runtime, requests)
    steps = runtime.engine.drain_steps()
    assert max(step.batch_size for step in steps) >= 4  # they really ran in one batch
    results = [run.prefilled.result for run in together]
    assert results.count("hit") == 4 and results.count("bypass") == 2 and "miss" in results and "skip" in results
    for (request, bypass), batched in zip(requests, together, strict=True):
        alone = generate(runtime, request, bypass=bypass)
        plain = generate(runtime, request, bypass=True)
        assert batched.finished.token_ids == alone.finished.token_ids == plain.finished.token_ids
        assert len(batched.finished.token_ids) == request["max_tokens"]
    assert not_kept(runtime) == sum(runtime.engine.pool.blocks_for(e.num_tokens) for e in runtime.store.ram.entries())


def test_seeded_sampling_is_the_same_batched_and_alone(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    requests = [(body(merchant_tools[:4], q, max_tokens=10, temperature=0.8, top_p=0.9, seed=7 + i), False)
                for i, q in enumerate(QUESTIONS[:4])]
    together = run_together(runtime, requests)
    for (request, _), batched in zip(requests, together, strict=True):
        assert batched.finished.token_ids == generate(runtime, request).finished.token_ids


def test_a_hit_is_served_while_another_group_compiles(runtime_for, merchant_tools):
    """Chunked prefill: a hit sent after a long group's miss finishes before that compile does."""
    runtime = runtime_for("llama", prefill_chunk_tokens=16)
    generate(runtime, body(merchant_tools[:3], "warm", max_tokens=1))
    order: list[tuple[str, str]] = []

    async def main() -> None:
        compile_task = asyncio.ensure_future(_run(runtime, body(merchant_tools[10:35], "Refunds?", max_tokens=2),
                                                  order=order, label="compile"))
        await asyncio.sleep(0)  # the miss is submitted first
        hit = await _run(runtime, body(merchant_tools[:3], "Top sellers?", max_tokens=4), order=order, label="hit")
        assert hit.prefilled.result == "hit"
        assert (await compile_task).prefilled.result == "miss"

    asyncio.run(main())
    assert order.index(("hit", "finished")) < order.index(("compile", "prefilled"))


def test_requests_wait_for_blocks_instead_of_failing(runtime_for, merchant_tools):
    """A pool with room for about two requests: eight at once all finish, with their own tokens."""
    runtime = runtime_for("llama", ram_budget_bytes=TINY_KV_BYTES_PER_TOKEN * 2200)
    requests = [(body(merchant_tools[:3], q, max_tokens=8), True) for q in QUESTIONS[:8]]
    runtime.engine.drain_steps()
    together = run_together(runtime, requests)
    assert max(step.batch_size for step in runtime.engine.drain_steps()) < len(requests)  # some waited
    for (request, _), batched in zip(requests, together, strict=True):
        assert batched.finished.token_ids == generate(runtime, request, bypass=True).finished.token_ids
    assert not_kept(runtime) == 0


def test_a_request_the_pool_can_never_hold_is_refused(runtime_for, merchant_tools):
    runtime = runtime_for("llama", ram_budget_bytes=TINY_KV_BYTES_PER_TOKEN * 300)
    with pytest.raises(Overloaded, match="KV pool"):
        generate(runtime, body(merchant_tools[:3], "hi", max_tokens=400))
    assert generate(runtime, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "temperature": 0}).finished.completion_tokens == 4


def test_a_cancelled_request_leaves_the_batch_and_frees_its_blocks(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    generate(runtime, body(merchant_tools[:3], "warm", max_tokens=1))
    held = not_kept(runtime)

    async def main() -> None:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(
            body(merchant_tools[:3], "Tell me everything", max_tokens=2000)))
        events = runtime.service.events(prepared)
        async for event in events:
            if isinstance(event, TextDelta):
                break
        await events.aclose()  # the client goes away
        other = await _run(runtime, body(merchant_tools[:3], "hi", max_tokens=3))
        assert other.finished.completion_tokens == 3

    asyncio.run(main())
    assert not_kept(runtime) == held
    assert runtime.engine.stats().cancelled_total == 1


def test_warming_a_group_does_not_stop_the_requests_running(runtime_for, merchant_tools):
    """Warm-up compiles in chunks on the step loop: a request sent after it finishes first."""
    from gateway.serving.cache_admin import WarmRequest, plan_warm, warm_plan

    runtime = runtime_for("llama", prefill_chunk_tokens=16)
    plan = plan_warm(runtime.service, WarmRequest.model_validate({"tools": merchant_tools[10:35]}), 256)
    warmed = warm_plan(runtime.engine, plan)
    run = generate(runtime, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert run.finished.completion_tokens == 4
    assert not warmed.done()
    assert warmed.result(timeout=300).already_cached is False
    assert warm_plan(runtime.engine, plan).result(timeout=60).already_cached is True


def test_a_listener_whose_event_loop_closed_mid_answer_is_dropped_and_the_engine_serves_on(runtime_for,
                                                                                          merchant_tools):
    """A caller's event loop closes while its answer is still being written (nothing closed the
    stream): the engine stops that job, gives its blocks back, and answers the next request."""
    runtime = runtime_for("llama")
    request = body(merchant_tools[:3], "hi", max_tokens=3)
    expected = generate(runtime, request).finished
    held = not_kept(runtime)

    async def first_token() -> None:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(
            body(merchant_tools[:3], "Tell me everything", max_tokens=2000)))
        async for event in runtime.service.events(prepared):
            if isinstance(event, TextDelta):
                return  # the stream is left open, and its loop closed under it

    loop = asyncio.new_event_loop()
    loop.run_until_complete(first_token())
    loop.close()

    async def after() -> Run:
        return await asyncio.wait_for(_run(runtime, request), timeout=60)

    assert asyncio.run(after()).finished == expected
    assert not_kept(runtime) == held


def test_a_fault_in_the_step_loop_fails_the_running_requests_and_the_engine_serves_on(runtime_for, merchant_tools,
                                                                                     monkeypatch):
    """Whatever raises in a step outside the model (here the scheduler, once) fails the requests
    running then with an error event; the engine thread lives on and answers the next request."""
    runtime = runtime_for("llama")
    request = body(merchant_tools[:3], "hi", max_tokens=3)
    expected = generate(runtime, request).finished
    held = not_kept(runtime)
    planner = runtime.engine.scheduler.planner
    plan = planner.plan

    def faulty(running: Any) -> Any:
        if any(seq.generated == 2 for seq in running):
            monkeypatch.undo()
            raise RuntimeError("a bug")
        return plan(running)

    monkeypatch.setattr(planner, "plan", faulty)

    async def main() -> list[Any]:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request))
        return [event async for event in runtime.service.events(prepared)]

    events = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert isinstance(events[-1], Failed) and "generation failed" in events[-1].message
    assert generate(runtime, request).finished == expected
    assert not_kept(runtime) == held
