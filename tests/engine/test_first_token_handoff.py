"""The engine never waits on the web server: a streamed answer is written whole while its stream
sends nothing (its event loop blocked after the first event), and it is the same answer. Before,
the engine paused after each request's first token until the stream said it was sent (up to 50
ms, the device idle meanwhile)."""

from __future__ import annotations

import asyncio
import threading

from gateway.engine import Failed, Finished
from gateway.engine.events import EngineEvent, Job, JobStream
from gateway.protocol.answer import Ended, TextWritten
from gateway.protocol.chat import ChatCompletionRequest
from tests.engine.conftest import generate


def test_an_answer_is_written_whole_while_its_stream_sends_nothing(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refunds?"}],
            "tools": merchant_tools[:3], "tool_choice": "none", "temperature": 0, "max_tokens": 6}
    plain = generate(runtime, body)
    prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(body))
    done, submit = threading.Event(), runtime.engine.submit

    def submitting(job: Job) -> JobStream:  # a note when the engine is done, besides the stream
        def emitting(event: EngineEvent) -> None:
            if isinstance(event, (Finished, Failed)):
                done.set()

        job.emit = emitting
        return submit(job)

    runtime.engine.submit = submitting  # type: ignore[method-assign]

    async def main() -> tuple[bool, str, Ended]:
        stream = runtime.service.stream(prepared)
        await anext(stream)  # the prompt is in
        written = done.wait(timeout=120)  # the event loop is blocked: the stream sends nothing meanwhile
        events = [event async for event in stream]
        text = "".join(e.text for e in events if isinstance(e, TextWritten))
        assert isinstance(events[-1], Ended)
        return written, text, events[-1]

    written, text, ended = asyncio.run(main())
    assert written  # the engine finished without the stream sending a byte
    assert text == plain.text and ended.usage.completion_tokens == plain.finished.completion_tokens == 6
