"""Every cache and store is bounded in bytes, counting what it keeps alive (issue 25, item 2), on
a real server with two API keys and small budgets:

- the Responses store charges a key for every turn its kept responses keep alive (a parent that
  continuations pin stays charged after its own response leaves the index), so small
  continuations of a big response cannot hold more than the key's budget; a continuation whose
  chain alone is over the budget is refused with a 400 before any work;
- the grammar cache is bounded by the grammars' estimated bytes, not their count;
- the tokenizer's remembered tool-group heads are bounded in bytes, each key to its share.

Each bound is exported as a gauge on /metrics, read here as a client reads it.

And what each store really holds, measured with tracemalloc (deterministic, unlike RSS on a shared
machine) against its configured bound (issue 36, item 3): the Responses store (it kept parsed
objects ~20 times their counted JSON), the schema memo, the pins and retentions, the conversation
records; the metrics' label sets stay fixed whatever clients send."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.responses.store import (
    RESPONSE_OVERHEAD_BYTES,
    TURN_OVERHEAD_BYTES,
    ResponseStore,
    StoredResponse,
    Turn,
)
from gateway.edge.admission import tenant_salt
from gateway.engine.prefix_index import Conversations, Record, chain_hashes
from gateway.kvcache import pins as pins_module
from gateway.kvcache.block_pool import BlockPool, PoolShape
from gateway.kvcache.pins import Pins
from gateway.serving.grammars import SchemaMemo, grammar_bytes
from gateway.settings import load_settings
from tests.support.server import LiveServer, serve

KEY_A, KEY_B = "key-alpha-bounded-1", "key-beta-bounded-2"
SALT_A, SALT_B = tenant_salt(KEY_A.encode()), tenant_salt(KEY_B.encode())
MODEL = "tiny-llama"
STORE_BUDGET = 20_000  # bytes of kept Responses per key
GRAMMAR_BUDGET = 3 * 1024**2
HEADS_BUDGET = 200_000  # each key a quarter: 50,000
FILLER = "international organization development environment "  # ~13 characters a token


def filler(chars: int, tag: str) -> str:
    return (tag + " " + FILLER * (chars // len(FILLER) + 1))[:chars]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    settings = load_settings(overrides={
        "model": str(tiny_model_dir("llama")), "served_model_name": MODEL, "min_prefix_tokens": 8,
        "api_keys": (KEY_A, KEY_B), "max_stored_response_bytes": STORE_BUDGET,
        "grammar_cache_bytes": GRAMMAR_BUDGET, "tokenizer_heads_bytes": HEADS_BUDGET,
        "cache_dir": str(tmp_path_factory.mktemp("cache"))}, environ={})
    with serve(settings) as live:
        yield live


def post(live: LiveServer, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.api_url + path, json={"model": MODEL, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def respond(live: LiveServer, key: str, **body: Any) -> dict[str, Any]:
    resp = post(live, "/responses", key, {"max_output_tokens": 3, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def gauge(live: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no {name} {labels} on /metrics")


def retained_bytes(store: ResponseStore, tenant: str, response_ids: list[str]) -> int:
    """What `tenant`'s kept responses really hold, measured apart from the store's own count:
    each kept response's body and input items, and every turn reachable from one, once, as JSON,
    with the objects' allowance (its measure: test_the_responses_store_holds_what_it_counts)."""
    total, seen = 0, set()
    for response_id in response_ids:
        stored = store.get(tenant, response_id)
        if stored is None:
            continue
        total += len(orjson.dumps(stored.body)) + len(orjson.dumps(stored.input_items)) + RESPONSE_OVERHEAD_BYTES
        node: Turn | None = stored.turn
        while node is not None and id(node) not in seen:
            seen.add(id(node))
            total += len(orjson.dumps(node.messages)) + TURN_OVERHEAD_BYTES
            node = node.parent
    return total


# ---- the Responses store ---------------------------------------------------------------------


def test_small_continuations_pinning_a_big_response_stay_within_the_key_budget(keyed):
    """A big response continued fifteen times with small inputs, each continuing the last: the
    big one leaves the index, but its turn stays alive in every continuation's conversation. What
    the key really holds (measured by walking the kept responses) stays within its budget and
    equals the store's own count: the oldest continuations are evicted, the newest continued."""
    store: ResponseStore = keyed.app.state.gateway.responses
    last = respond(keyed, KEY_A, input=filler(8000, "the big one"))
    ids = [last["id"]]
    for n in range(15):
        last = respond(keyed, KEY_A, input=f"ok {n}", previous_response_id=last["id"])
        ids.append(last["id"])
    held = retained_bytes(store, SALT_A, ids)
    assert 0 < held <= STORE_BUDGET
    assert store.tenant_bytes(SALT_A) == held
    assert store.get(SALT_A, ids[0]) is None and store.get(SALT_A, ids[1]) is None  # the oldest went
    newest = respond(keyed, KEY_A, input="and then?", previous_response_id=ids[-1])
    assert store.get(SALT_A, newest["id"]) is not None
    assert retained_bytes(store, SALT_A, [*ids, newest["id"]]) <= STORE_BUDGET
    assert gauge(keyed, "toolkv_responses_store_bytes") == store.num_bytes
    assert gauge(keyed, "toolkv_memory_budget_bytes", structure="responses_store_per_key") == STORE_BUDGET


def test_a_continuation_whose_chain_alone_exceeds_the_budget_is_refused_before_any_work(keyed):
    store: ResponseStore = keyed.app.state.gateway.responses
    first = respond(keyed, KEY_B, input=filler(4000, "first"))
    before = store.tenant_bytes(SALT_B)
    big_next = {"input": filler(9000, "second"), "previous_response_id": first["id"], "max_output_tokens": 3}
    resp = post(keyed, "/responses", KEY_B, big_next)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("conversation_too_large", "previous_response_id")
    assert "store" in error["message"] and str(STORE_BUDGET) in error["message"]
    assert store.tenant_bytes(SALT_B) == before and store.get(SALT_B, first["id"]) is not None
    unstored = post(keyed, "/responses", KEY_B, {**big_next, "store": False})  # not kept: nothing to refuse
    assert unstored.status_code == 200, unstored.text
    assert store.tenant_bytes(SALT_B) == before


def test_a_response_the_store_cannot_take_says_store_false(keyed):
    """Its input passes the check made before any work, but with its answer the response is over the
    key's budget: it said `"store": true`, then GET was a 404 and continuing it a 400."""
    store: ResponseStore = keyed.app.state.gateway.responses
    before = store.tenant_bytes(SALT_B)
    body = respond(keyed, KEY_B, input=filler(STORE_BUDGET * 48 // 100, "near the budget"))  # twice kept: turn, item
    assert store.get(SALT_B, body["id"]) is None and store.tenant_bytes(SALT_B) == before
    assert body["store"] is False
    kept = respond(keyed, KEY_B, input="small")
    assert kept["store"] is True and store.get(SALT_B, kept["id"]) is not None


# ---- the grammar cache -----------------------------------------------------------------------


def answer_schema(n: int, description_chars: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{n}": {"type": "string", "description": "d" * description_chars}},
            "required": [f"field_{n}"]}


def structured(live: LiveServer, key: str, schema: dict[str, Any]) -> None:
    resp = post(live, "/chat/completions", key, {
        "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 2, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert resp.status_code == 200, resp.text


def test_the_grammar_cache_is_bounded_by_bytes_not_by_count(keyed):
    """Four distinct ~25 KB schemas (each grammar estimated at ~1 MB): at most what fits the
    3 MiB budget is kept, the least recently used first out."""
    grammars = keyed.app.state.gateway.model.runtime.service.grammars
    for n in range(4):
        structured(keyed, KEY_A, answer_schema(n, 25_000))
    kept = [g for g in grammars.cached(SALT_A) if "d" * 25_000 in g]
    assert len(kept) == 2 and all("field_3" in g or "field_2" in g for g in kept)
    assert grammars.num_bytes <= GRAMMAR_BUDGET
    assert grammars.num_bytes == sum(grammar_bytes(g) for ns in (SALT_A, SALT_B, "") for g in grammars.cached(ns))
    assert gauge(keyed, "toolkv_grammar_cache_bytes") == grammars.num_bytes
    assert gauge(keyed, "toolkv_memory_budget_bytes", structure="grammar_cache") == GRAMMAR_BUDGET


def test_one_keys_many_schemas_evict_its_own_grammars_not_another_keys(keyed):
    """Key A sends schema after schema; key B's one grammar stays compiled (its next request does
    not pay for A's flood): past the budget, the key keeping the most gives up its oldest."""
    grammars = keyed.app.state.gateway.model.runtime.service.grammars
    structured(keyed, KEY_B, answer_schema(100, 25_000))
    [mine] = [g for g in grammars.cached(SALT_B) if "field_100" in g]
    compiles = grammars.compiles
    for n in range(101, 106):
        structured(keyed, KEY_A, answer_schema(n, 25_000))
    assert grammars.compiles == compiles + 5
    assert mine in grammars.cached(SALT_B)
    assert grammars.num_bytes <= GRAMMAR_BUDGET
    structured(keyed, KEY_B, answer_schema(100, 25_000))
    assert grammars.compiles == compiles + 5  # reused, not compiled again


# ---- the tokenizer's heads -------------------------------------------------------------------


def tool_group(n: int) -> list[dict[str, Any]]:
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}}
    return [{"type": "function", "function": {"name": f"tool_{n}_{i}", "description": filler(2500, f"tool {n} {i}"),
                                              "parameters": parameters}} for i in range(4)]


def test_remembered_tokenizer_heads_are_bounded_in_bytes_per_key(keyed):
    """Five distinct ~10 KB tool groups from one key: its heads stay within its share of the
    budget (a quarter), so the first groups are forgotten although the count bound (64) is far."""
    tokens = keyed.app.state.gateway.model.runtime.service.prompt_tokens
    for n in range(5):
        resp = post(keyed, "/chat/completions", KEY_A, {
            "messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "hi"}],
            "tools": tool_group(n), "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
    remembered = tokens.remembered(SALT_A)
    assert 1 <= len(remembered) < 5 and "tool_4_0" in remembered[-1]
    assert not any("tool_0_0" in text for text in remembered)
    assert tokens.num_bytes <= HEADS_BUDGET and tokens.max_bytes_per_namespace == HEADS_BUDGET // 4
    assert gauge(keyed, "toolkv_tokenizer_heads_bytes") == tokens.num_bytes


# ---- what each store really holds (tracemalloc) ----------------------------------------------


def traced_growth(fill: Callable[[], object]) -> tuple[int, object]:
    """The bytes Python holds after `fill()` that `fill()` allocated (what it returns is kept
    alive). Only blocks allocated with this file on the stack count: in a whole run, other
    tests' servers and threads allocate in the same process meanwhile."""
    gc.collect()
    tracemalloc.start(8)
    try:
        kept = fill()
        gc.collect()
        ours = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, __file__, all_frames=True)])
        return sum(stat.size for stat in ours.statistics("filename")), kept
    finally:
        tracemalloc.stop()


def many_empty_lists(count: int) -> list[Any]:
    """What a body echoing a schema of many `[]` parses into: 3 bytes of JSON, 64 bytes of list each."""
    return list(orjson.loads(b"[" + b"[]," * (count - 1) + b"[]]"))


def test_the_responses_store_holds_what_it_counts():
    """17 MB counted held 330 MB: the store counted JSON bytes and kept parsed objects. Four keys
    fill it well past its bound with bodies of many `[]`; what it holds stays within the bound."""
    budget = 2 * 1024**2

    def fill() -> ResponseStore:
        store = ResponseStore(max_per_tenant=1000, max_bytes_per_tenant=budget // 2, max_bytes=budget)
        for n in range(400):
            body = {"id": f"resp_{n}", "object": "response", "output": many_empty_lists(3000)}
            turn = Turn(f"resp_{n}", ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "[]"}))
            store.put(f"tenant-{n % 4}", StoredResponse(turn, body, ({"id": f"msg_{n}", "type": "message"},)))
        return store

    held, store = traced_growth(fill)
    assert isinstance(store, ResponseStore) and 0 < store.num_bytes <= budget
    assert len(store) < 400  # the bound evicted
    assert held <= budget, f"{held} bytes held for {store.num_bytes} counted"
    kept = store.get("tenant-3", "resp_399")
    assert kept is not None and len(kept.body["output"]) == 3000  # parsed again on read


def test_many_small_responses_hold_no_more_than_counted():
    """orjson's output keeps a 4 KiB buffer: small responses held 4 KiB per object, counted ~100."""
    def fill() -> ResponseStore:
        store = ResponseStore(max_per_tenant=10_000)
        for n in range(3000):
            store.put("t", StoredResponse(Turn(f"resp_{n}", ({"role": "user", "content": "hi"},)), {"id": n}))
        return store

    held, store = traced_growth(fill)
    assert isinstance(store, ResponseStore) and held <= store.num_bytes


def test_the_schema_memo_holds_no_more_than_its_bound():
    budget = 1024**2

    def fill() -> SchemaMemo:
        memo = SchemaMemo(max_bytes=budget)
        for n in range(20_000):  # small schemas: each key a few dozen bytes of JSON
            memo.get("rule", f"tenant-{n % 3}", {"type": "object", "title": f"s{n}"}, lambda n=n: f"rule_{n}")
        return memo

    held, memo = traced_growth(fill)
    assert isinstance(memo, SchemaMemo) and 0 < memo.num_bytes <= budget
    assert held <= budget, f"{held} bytes held for {memo.num_bytes} counted"


def test_a_flood_of_retentions_holds_a_bounded_number_of_records():
    """Each request naming a new tool group with 24h retention added a record, in memory for good."""
    bound = pins_module._MAX_RECORDS

    def fill() -> Pins:
        pins = Pins(None)
        for n in range(bound * 3 // 2):
            pins.retain(f"{n:064x}", 3600.0 + n, tenant=f"key-{n % 5}")
        return pins

    held, pins = traced_growth(fill)
    assert isinstance(pins, Pins) and len(pins.retained()) <= bound + bound // 8
    assert held <= (bound + bound // 8) * 400, f"{held} bytes for {len(pins.retained())} records"
    assert f"{bound * 3 // 2 - 1:064x}" in pins.retained()  # the latest deadlines stay


def test_conversation_records_hold_no_more_than_their_bound():
    """A record holding one block kept its whole prompt's ids and chain: long prompts with a short
    own part held ~180 KB each beside an 8-byte block, bounded by nothing but the pool's blocks."""
    pool = BlockPool(PoolShape(1, 1, 2, torch.float32), 16 * 4 * 400, 4, torch.device("cpu"))  # 400 blocks
    budget = 1024**2

    def fill() -> Conversations:
        conversations = Conversations(block_tokens=4, max_bytes=budget)
        for n in range(300):
            tokens = tuple(range(10_000 * n + 1000, 10_000 * n + 3000))  # a 2,000-token prompt, ids past 256
            run = pool.allocate(4)  # its own part: one block after a long group
            assert run is not None
            conversations.add(Record(tokens, len(tokens) - 4, frozenset({len(tokens)}), run,
                                     chain_hashes(b"tenant", tokens, 4)))
        return conversations

    held, conversations = traced_growth(fill)
    assert isinstance(conversations, Conversations) and 0 < conversations.num_bytes <= budget
    assert held <= budget, f"{held} bytes held by {len(conversations)} records"
    assert pool.num_used == conversations.num_blocks  # evicted records gave their blocks back


def series_count(live: LiveServer) -> int:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def test_what_clients_send_never_adds_metric_label_sets(keyed):
    """Model names, paths, keys, headers and bad bodies: none becomes a label value, so the number
    of series stays what it was however many distinct values clients send."""
    def burst(n: int) -> None:
        for i in range(n):
            post(keyed, "/chat/completions", KEY_A, {"model": f"model-{i}", "messages": [{"role": "user"}]})
            httpx.get(f"{keyed.api_url}/nope-{i}", headers={"Authorization": f"Bearer wrong-{i}"}, timeout=30)
            post(keyed, "/responses", f"bad-key-{i}", {"input": "hi"})

    burst(3)  # every kind of failure seen once: its series exist
    before = series_count(keyed)
    burst(30)
    assert series_count(keyed) == before
