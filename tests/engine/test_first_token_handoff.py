"""The engine pauses after the first token until the stream has sent it; a consumer that never
says so must not stall the generation, and the pause must not change what is generated."""

from __future__ import annotations

import threading

from gateway.protocol.chat import ChatCompletionRequest
from tests.engine.conftest import generate


def test_a_first_token_never_acknowledged_still_finishes_with_the_same_text(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refunds?"}],
            "tools": merchant_tools[:3], "tool_choice": "none", "temperature": 0, "max_tokens": 6}
    plain = generate(runtime, body)
    original = runtime.service.prepare

    def never_acknowledged(req: ChatCompletionRequest, **kwargs):
        prepared = original(req, **kwargs)
        prepared.job.first_token_sent = threading.Event()  # nobody sets it
        return prepared

    runtime.service.prepare = never_acknowledged  # type: ignore[method-assign]
    paused = generate(runtime, body)
    assert paused.finished.completion_tokens == plain.finished.completion_tokens == 6
    assert paused.text == plain.text and paused.finished.token_ids == plain.finished.token_ids
