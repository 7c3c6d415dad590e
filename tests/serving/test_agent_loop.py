"""An agent loop through the HTTP API: recorded tau-bench airline turns (a long policy + 14 tools,
then a growing history of calls and results) hit the cached tool group from the second step on,
and each step reuses more of the conversation before it."""

from __future__ import annotations

import pytest

from tests.serving.test_families import tau_turns
from tests.serving.wire import post
from tests.support.family_models import SETUPS


@pytest.mark.parametrize("setup", list(SETUPS))
def test_every_step_after_the_first_hits_the_tool_group_and_the_history_before_it(family_server, setup):
    live = family_server(setup)
    usages = []
    for turn in tau_turns(task_id=2, count=3):
        resp = post(live, {"messages": turn["messages"], "tools": turn["tools"], "max_tokens": 1,
                           "temperature": 0})
        usages.append(resp["usage"])
    first, *later = usages
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert all(u["prompt_tokens"] > first["prompt_tokens"] for u in later)  # the history grew
    assert 1000 < cached[1] < cached[2]  # the group, then more of the conversation each step
    assert cached[2] > usages[1]["prompt_tokens"] - 400  # all but the previous step's last messages
