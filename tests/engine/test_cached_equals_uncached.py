"""The invariant toolkv exists for: a cached prefix gives the same tokens as computing it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.conftest import generate, not_kept

ARCHS = ["llama", "qwen2", "mistral"]


def body(tools: list[dict[str, Any]], question: str = "What was GMV last week?", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You are a merchant assistant."},
                         {"role": "user", "content": question}],
            "tools": tools, "temperature": 0, "max_tokens": 24, **extra}


@pytest.mark.parametrize("arch", ARCHS)
def test_miss_hit_and_bypass_give_identical_greedy_tokens(runtime_for, merchant_tools, arch):
    runtime = runtime_for(arch)
    request = body(merchant_tools[:6])
    miss = generate(runtime, request)
    hit = generate(runtime, request)
    plain = generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result, plain.prefilled.result) == ("miss", "hit", "bypass")
    assert len(miss.finished.token_ids) == 24
    assert miss.finished.token_ids == hit.finished.token_ids == plain.finished.token_ids
    assert miss.text == hit.text == plain.text


@pytest.mark.parametrize("arch", ARCHS)
def test_hit_reports_the_whole_tool_group_as_cached(runtime_for, merchant_tools, arch):
    runtime = runtime_for(arch)
    request = body(merchant_tools[:6])
    from gateway.protocol.chat import ChatCompletionRequest

    prepared = runtime.service.prepare(ChatCompletionRequest.model_validate(request))
    tokenizer = runtime.loaded.tokenizer
    prefix_text = tokenizer.decode(prepared.job.prompt_ids[: prepared.job.prefix_len])
    assert prefix_text.endswith("</tool_call><|im_end|>\n")  # the cut is at the end of the system turn
    generate(runtime, request)
    hit = generate(runtime, body(merchant_tools[:6], question="And yesterday?"))
    assert hit.prefilled.result == "hit"
    assert hit.prefilled.cached_tokens == prepared.job.prefix_len
    assert hit.prefilled.prompt_tokens > hit.prefilled.cached_tokens


def test_sampling_with_a_seed_is_the_same_on_hit_and_miss(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    request = body(merchant_tools[:4], temperature=0.9, top_p=0.9, seed=1234)
    miss = generate(runtime, request)
    hit = generate(runtime, request)
    assert hit.prefilled.result == "hit"
    assert miss.finished.token_ids == hit.finished.token_ids


def test_logprobs_penalties_and_logit_bias_are_the_same_on_miss_hit_and_bypass(runtime_for, merchant_tools):
    """The sampling fields act on the logits the same way whatever the cache did: same tokens,
    and bit-identical logprobs and alternatives."""
    runtime = runtime_for("llama")
    request = body(merchant_tools[:5], logprobs=True, top_logprobs=5, presence_penalty=0.7, frequency_penalty=1.3,
                   logit_bias={"260": 2.0, "28": -3.0})
    miss = generate(runtime, request)
    hit = generate(runtime, request)
    plain = generate(runtime, request, bypass=True)
    assert (miss.prefilled.result, hit.prefilled.result, plain.prefilled.result) == ("miss", "hit", "bypass")
    assert len(miss.logprobs) == len(miss.finished.token_ids) == 24
    assert [e.token_id for e in miss.logprobs] == list(miss.finished.token_ids)
    assert miss.finished.token_ids == hit.finished.token_ids == plain.finished.token_ids
    assert miss.logprobs == hit.logprobs == plain.logprobs
    assert all(len(e.top) == 5 for e in miss.logprobs)
    unbiased = generate(runtime, body(merchant_tools[:5]))
    assert unbiased.finished.token_ids != miss.finished.token_ids  # the fields did act


def test_tool_order_hits_the_same_entry_and_a_changed_tool_misses(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    tools = merchant_tools[:5]
    assert generate(runtime, body(tools)).prefilled.result == "miss"
    assert generate(runtime, body(list(reversed(tools)))).prefilled.result == "hit"
    changed = [dict(tools[0], function=dict(tools[0]["function"], description="changed"))] + tools[1:]
    assert generate(runtime, body(changed)).prefilled.result == "miss"


def test_system_prompt_change_never_serves_the_old_kv(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    first = body(merchant_tools[:5])
    generate(runtime, first)
    second = dict(first, messages=[{"role": "system", "content": "You are a refund assistant."},
                                   first["messages"][1]])
    run = generate(runtime, second)
    plain = generate(runtime, second, bypass=True)
    assert run.prefilled.result == "miss"
    assert run.finished.token_ids == plain.finished.token_ids


def test_short_prefix_is_not_cached(runtime_for):
    runtime = runtime_for("llama", min_prefix_tokens=10_000)
    run = generate(runtime, {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}],
                             "temperature": 0, "max_tokens": 4})
    assert run.prefilled.result == "skip"
    assert run.prefilled.cached_tokens == 0
    assert len(runtime.store.ram) == 0


def test_cache_off_in_settings_runs_plain_prefill(runtime_for, merchant_tools):
    runtime = runtime_for("llama", cache="off")
    runs = [generate(runtime, body(merchant_tools[:4])) for _ in range(2)]
    assert [r.prefilled.result for r in runs] == ["bypass", "bypass"]
    assert len(runtime.store.ram) == 0


def test_stop_sequence_and_max_tokens_end_generation(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    free = generate(runtime, body(merchant_tools[:4], max_tokens=16))
    assert free.finished.finish_reason == "length"
    assert free.finished.completion_tokens == 16
    stop = free.text[4:7]
    assert stop.strip()
    stopped = generate(runtime, body(merchant_tools[:4], max_tokens=16, stop=[stop]))
    assert stopped.finished.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)


def test_stored_prefix_tensors_are_never_written_by_requests(runtime_for, merchant_tools):
    runtime = runtime_for("llama")
    generate(runtime, body(merchant_tools[:4]))
    (entry,) = runtime.store.ram.entries()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in entry.layers]
    for question in ("one", "two", "three"):
        assert generate(runtime, body(merchant_tools[:4], question=question, max_tokens=40)).prefilled.result == "hit"
    after = [(layer.keys, layer.values) for layer in entry.layers]
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(before, after, strict=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_hits_read_the_groups_blocks_in_place_and_never_write_them(runtime_for, merchant_tools, arch):
    """The stored group is a run of pool blocks: a hit reads it with no copy, writes its own tokens
    into blocks of its own, and gives them back when done. Each hit equals its plain computation."""
    runtime = runtime_for(arch)
    generate(runtime, body(merchant_tools[:5], question="warm up", max_tokens=1))
    (entry,) = runtime.store.ram.entries()
    pool = runtime.engine.pool
    assert entry.blocks is not None
    assert entry.layers[0].keys.data_ptr() == pool.keys[0][:, entry.blocks.token_start].data_ptr()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in entry.layers]
    held = not_kept(runtime)
    for question, max_tokens in (("Refunds?", 20), ("Stock of item 7?", 6), ("Top sellers?", 40)):
        request = body(merchant_tools[:5], question=question, max_tokens=max_tokens)
        hit, plain = generate(runtime, request), generate(runtime, request, bypass=True)
        assert hit.prefilled.result == "hit"
        assert hit.finished.token_ids == plain.finished.token_ids and len(hit.finished.token_ids) == max_tokens
        assert not_kept(runtime) == held  # every block a request took is back (or kept for its next turn)
    after = [(layer.keys, layer.values) for layer in entry.layers]
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(before, after, strict=True))
