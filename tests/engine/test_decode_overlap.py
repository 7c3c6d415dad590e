"""Decode steps launched one ahead (`decode_overlap`, engine/decode_ahead.py): the tokens
of plain steps, requests that arrive or leave during a run of them served as before, and no KV of
a step computed past a sequence's end ever read. On the CPU a launch is the whole step, so the
setting is off by default there; these tests turn it on."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.engine import Failed, Finished, Prefilled, TextDelta
from gateway.protocol.chat import ChatCompletionRequest
from gateway.serving.runtime import Runtime
from tests.engine.conftest import generate, not_kept
from tests.engine.test_batching import _run, body, run_together


def plain(tools: list[dict[str, Any]], question: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A request whose rows are plain greedy (tool_choice none: the tools stay in the prompt, no
    grammar), the kind the engine launches ahead."""
    return body(tools, question, max_tokens=max_tokens, tool_choice="none", **extra)


def requests(tools: list[dict[str, Any]], stop: str = "e") -> list[dict[str, Any]]:
    return [plain(tools, "What was GMV last week?", 40),
            plain(tools, "Refunds?", 7),
            plain(tools, "List every product whose stock fell under ten units", 53),
            plain(tools, "hi", 2),
            plain(tools, "Top sellers?", 30, stop=[stop]),
            plain([], "Stock of item 7?", 45),
            body(tools, "Compare this month's orders with last month's", max_tokens=3)]  # a grammar (auto)


def test_overlapped_steps_give_every_request_the_tokens_it_gets_without_them(runtime_for, merchant_tools):
    """Seven requests at once (different lengths, a stop string, one without tools, one with a
    grammar) and each alone: token for token what the same model gives with every step read
    before the next, and steps were launched ahead."""
    tools = merchant_tools[:3]
    steps, ahead = runtime_for("llama", decode_overlap=False), runtime_for("llama", decode_overlap=True)
    free = generate(steps, plain(tools, "Top sellers?", 30)).text
    stop = free[len(free) // 2:len(free) // 2 + 3]  # it ends mid-run, the others running on
    expected = [generate(steps, r).finished for r in requests(tools, stop)]
    assert expected[4].stop_sequence == stop
    assert [generate(ahead, r).finished for r in requests(tools, stop)] == expected
    together = run_together(ahead, [(r, False) for r in requests(tools, stop)])
    assert [run.finished for run in together] == expected
    assert ahead.engine.ahead_steps > 0 and steps.engine.ahead_steps == 0
    assert not_kept(ahead) == not_kept(steps)  # the cached groups only: every sequence gave its blocks back


def test_a_request_sent_during_overlapped_steps_starts_before_they_end(runtime_for, merchant_tools):
    """A run of steps launched ahead yields to a new request within a step: its first token comes
    while a long answer is still being written, and it gets the tokens it gets alone."""
    runtime = runtime_for("llama", decode_overlap=True)
    short = plain(merchant_tools[:3], "Refunds?", 5)
    alone = generate(runtime, short).finished
    order: list[str] = []

    async def stream(request: dict[str, Any], label: str, started: asyncio.Event | None = None) -> Finished:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request))
        finished, deltas = None, 0
        async for event in runtime.service.events(prepared):
            if isinstance(event, Prefilled):
                order.append(f"{label} first")
            elif isinstance(event, TextDelta):
                deltas += 1
                if started is not None and deltas == 3:
                    started.set()
            elif isinstance(event, Finished):
                order.append(f"{label} done")
                finished = event
        assert finished is not None
        return finished

    async def main() -> Finished:
        started = asyncio.Event()
        long = asyncio.create_task(stream(plain(merchant_tools[:3], "Tell me everything", 400), "long", started))
        await started.wait()
        finished = await stream(short, "short")
        await long
        return finished

    assert asyncio.run(main()) == alone
    assert order.index("short done") < order.index("long done")


def test_a_client_gone_during_overlapped_steps_frees_its_blocks_and_leaves_no_stale_kv(runtime_for,
                                                                                      merchant_tools):
    """The client of a long answer goes away mid-run: its blocks come back, and the next requests,
    which may get those blocks and the KV computed past its end in them, give their own tokens."""
    runtime: Runtime = runtime_for("llama", decode_overlap=True)
    tools = merchant_tools[:3]
    expected = [generate(runtime, r).finished for r in requests(tools)]
    held = not_kept(runtime)

    async def main() -> list[Finished]:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(
            plain(tools, "Tell me everything", 2000)))
        events = runtime.service.events(prepared)
        deltas = 0
        async for event in events:
            if isinstance(event, TextDelta):
                deltas += 1
                if deltas == 5:
                    break
        await events.aclose()  # the client goes away
        runs = await asyncio.gather(*(_run(runtime, r) for r in requests(tools)))
        return [run.finished for run in runs]

    assert asyncio.run(main()) == expected
    assert not_kept(runtime) == held
    assert runtime.engine.stats().cancelled_total == 1


def test_a_forward_that_fails_during_overlapped_steps_fails_its_rows_and_the_engine_serves_on(
        runtime_for, merchant_tools, monkeypatch):
    """A step launched ahead raises (as a device error would): the request running gets an error
    event, its blocks come back, and the next request gets its own tokens."""
    runtime = runtime_for("llama", decode_overlap=True)
    request = plain(merchant_tools[:3], "Refunds?", 9)
    expected = generate(runtime, request).finished
    held = not_kept(runtime)
    runner = runtime.engine.runner
    forward = runner.forward

    def failing(tokens: Any, rows: Any, ids: Any = None) -> Any:
        if ids is not None and runtime.engine.ahead_steps > 3:
            raise RuntimeError("device error")
        return forward(tokens, rows, ids)

    monkeypatch.setattr(runner, "forward", failing)

    async def main() -> list[Any]:
        prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(
            plain(merchant_tools[:3], "Tell me everything", 200)))
        return [event async for event in runtime.service.events(prepared)]

    events = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert isinstance(events[-1], Failed) and "generation failed" in events[-1].message
    monkeypatch.undo()
    assert generate(runtime, request).finished == expected
    assert not_kept(runtime) == held


def test_steps_are_launched_ahead_while_jobs_wait_for_a_full_batch(runtime_for, merchant_tools):
    """Jobs waiting for a slot cannot run until a row ends, so they do not stop the run (under a
    load beyond max_batch it would never start); each request still gets the tokens it gets alone."""
    runtime = runtime_for("llama", decode_overlap=True, max_batch=2)
    tools = merchant_tools[:3]
    batch = [plain(tools, f"Question {i}?", 12 + 5 * i) for i in range(5)]
    expected = [generate(runtime, r).finished for r in batch]
    engine = runtime.engine
    launch, waiting = engine.ahead._launch, []

    def recording(seqs: Any, after: Any, rows: Any = None) -> Any:
        if after is not None:
            waiting.append(engine.queue_depth)
        return launch(seqs, after, rows)

    engine.ahead._launch = recording  # type: ignore[method-assign]
    assert [run.finished for run in run_together(runtime, [(r, False) for r in batch])] == expected
    assert max(waiting) > 0  # launched ahead with jobs in the intake


def test_sampled_rows_are_launched_ahead_too_and_a_seed_gives_the_same_tokens(runtime_for, merchant_tools):
    """Temperature and top-p rows are sampled on the device with the greedy ones, so they run ahead
    as well: seeded requests, together and alone, give the tokens they give with every step read
    first."""
    tools = merchant_tools[:3]
    sampled = [plain(tools, q, 24, temperature=0.9, top_p=0.95, seed=3 + i)
               for i, q in enumerate(("What was GMV last week?", "Refunds?", "Top sellers?"))]
    sampled.append(plain(tools, "hi", 20))  # greedy beside them
    steps, ahead = runtime_for("llama", decode_overlap=False), runtime_for("llama", decode_overlap=True)
    expected = [generate(steps, r).finished for r in sampled]
    assert [generate(ahead, r).finished for r in sampled[:3]] == expected[:3]
    assert ahead.engine.ahead_steps > 0  # sampled rows alone ran ahead
    together = run_together(ahead, [(r, False) for r in sampled])
    assert [run.finished.token_ids for run in together] == [f.token_ids for f in expected]


def tool_requests(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests with tools and `tool_choice: auto` (a grammar each), with logprobs, penalties,
    `logit_bias`, sampling, and a call forced by `required`."""
    return [body(tools, "What was GMV last week?", max_tokens=40, tool_choice="auto"),
            body(tools, "Refunds?", max_tokens=25, logprobs=True, top_logprobs=3),
            body(tools, "Top sellers?", max_tokens=30, frequency_penalty=0.8, presence_penalty=0.4,
                 logit_bias={"13": 3.0}),
            body(tools, "List low stock", max_tokens=30, temperature=0.8, top_p=0.9, seed=4),
            body(tools, "Cancel order W1", max_tokens=45, tool_choice="required")]


def test_tool_requests_are_sampled_on_the_device_and_run_ahead_with_the_tokens_of_steps_read_first(
        runtime_for, merchant_tools):
    """Rows with a grammar, logprobs, penalties or `logit_bias` are chosen on the device and run
    ahead (a grammar row on its mask guessed from the step before, checked once the token is
    read): each request, alone and together, gives the tokens and logprobs it gives with every
    step read before the next."""
    tools = merchant_tools[:3]
    steps, ahead = runtime_for("llama", decode_overlap=False), runtime_for("llama", decode_overlap=True)
    expected = [generate(steps, r) for r in tool_requests(tools)]
    alone = generate(ahead, tool_requests(tools)[0])  # tools with tool_choice auto, alone: on the fast path
    assert alone.finished == expected[0].finished and ahead.engine.ahead_steps > 0
    runs = [generate(ahead, r) for r in tool_requests(tools)]
    assert [run.finished for run in runs] == [run.finished for run in expected]
    assert [run.logprobs for run in runs] == [run.logprobs for run in expected]
    together = run_together(ahead, [(r, False) for r in tool_requests(tools)])
    assert [run.finished for run in together] == [run.finished for run in expected]
    assert not_kept(ahead) == not_kept(steps)
