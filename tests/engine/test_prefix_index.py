"""Where prompts are cut, how far an earlier prompt's KV may be used, and that the block index
trusts token ids, never a hash alone (gateway/engine/prefix_index.py; the turn opening:
gateway/serving/prompt_tokens.py)."""

from __future__ import annotations

import pytest
import torch

from gateway.engine.prefix_index import Conversations, Record, chain_hashes, chunk_ends, reuse_end
from gateway.kvcache.block_pool import BlockPool, PoolShape
from gateway.serving.prompt_tokens import turn_opening

pytestmark = pytest.mark.model_free  # no model, no server: in the fast subset

M = 1  # the turn marker in these prompts


def test_the_group_is_cut_on_a_grid_and_the_rest_at_markers_then_on_a_grid_from_each():
    ids = [5] * 300 + [M] + [6] * 10 + [M] + [7] * 40
    assert chunk_ends(ids, 300, 128, (M,)) == [128, 256, 300, 313, 352]
    assert chunk_ends(ids, 300, 32, (M,)) == [32, 64, 96, 128, 160, 192, 224, 256, 288, 300, 313, 345, 352]
    assert chunk_ends([M, 2, 3], 0, 128, ()) == [3]


def test_only_an_assistant_turns_opening_cuts_one_token_after_it_so_a_turn_is_one_chunk():
    A, U = 2, 3  # `<marker> assistant`, `<marker> user`
    ids = [5] * 10 + [M, U, 7, 7] + [M, A, 8, 8] + [M, U, 9] + [M, U, 9] + [M, A]
    assert chunk_ends(ids, 10, 128, (M, A)) == [10, 17, 26]  # a hit's new tokens: one chunk


def test_a_next_turn_reuses_the_whole_earlier_prompt_its_generation_prompt_included():
    old = [9] * 20 + [M, 2, 3, 4] + [M, 8]  # ... user turn, then `<marker>` and its blank
    new = old + [5, 5, 5] + [M, 6, 6] + [M, 8]  # the answer, a tool result, a new generation prompt
    new_ends, old_ends = chunk_ends(new, 20, 128, (M,)), set(chunk_ends(old, 20, 128, (M,)))
    assert reuse_end(new_ends, old_ends, len(old), len(old), len(new), 20) == len(old)
    edited = old[:22] + [7] + old[23:]  # a change inside the user turn: only the group is left
    assert reuse_end(chunk_ends(edited, 20, 128, (M,)), old_ends, 22, len(old), len(edited), 20) == 20
    # the very same prompt again: its last chunk is computed (the logits come from it)
    assert reuse_end(chunk_ends(old, 20, 128, (M,)), old_ends, len(old), len(old), len(old), 20) == 20


def _record(pool: BlockPool, tokens: list[int], root: bytes) -> Record:
    run = pool.allocate(len(tokens))
    assert run is not None
    return Record(tuple(tokens), 0, frozenset(chunk_ends(tokens, 0, 128, (M,))), run, chain_hashes(root, tokens, 4))


def test_the_index_never_trusts_a_hash_alone_and_tenants_chains_never_meet():
    pool = BlockPool(PoolShape(1, 1, 2, torch.float32), 1 << 16, 4, torch.device("cpu"))
    conversations = Conversations(block_tokens=4)
    mine = [M, 2, 3, 4, 5, 6, 7, 8, M, 9]
    conversations.add(_record(pool, mine, b"tenant-a"))
    assert conversations.find(mine, chain_hashes(b"tenant-a", mine, 4)) is not None
    assert conversations.find(mine, chain_hashes(b"tenant-b", mine, 4)) is None
    other = [M, 2, 3, 4, 50, 60, 70, 80, M, 9]
    forged = chain_hashes(b"tenant-a", mine, 4)  # as if `other` collided with `mine` on every block
    assert conversations.find(other, forged) is None


def test_a_record_covered_by_a_later_turn_goes_and_eviction_frees_its_blocks():
    pool = BlockPool(PoolShape(1, 1, 2, torch.float32), 1 << 16, 4, torch.device("cpu"))
    conversations = Conversations(block_tokens=4)
    first = _record(pool, [M, 2, 3, 4, 5, 6, 7, 8], b"r")
    conversations.add(first)
    second = _record(pool, [M, 2, 3, 4, 5, 6, 7, 8, M, 9, 9, 9], b"r")
    conversations.add(second, replaces=first)
    assert conversations.records() == [second] and pool.num_used == second.num_blocks
    assert conversations.evict_oldest() and pool.num_used == 0 and len(conversations) == 0


def test_the_turn_opening_is_the_generation_prompt_without_its_trailing_blank(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    opening = turn_opening(tokenizer, tokenizer.chat_template)
    assert tokenizer.decode(opening) == "<|im_start|>assistant"  # the newline after it is left out


def test_a_hit_is_one_chunk_after_its_group_and_the_next_turn_reuses_the_whole_prompt(tokenizer_dir):
    """With the default model's tokenizer and template: the generation prompt's blank survives an
    answer after it, so the cut one token past the opening is the earlier prompt's end."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    opening = turn_opening(tokenizer, tokenizer.chat_template)

    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    first = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Where is my order?"}]
    asked = ids(first)
    assert chunk_ends(asked, 8, 128, opening) == [8, len(asked)]  # one forward pass after the group
    for answer in ("It shipped.", '<tool_call>\n{"name": "track"}\n</tool_call>', " Sure"):
        turn = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks"}]
        assert len(asked) in chunk_ends(ids(turn), 8, 128, opening), answer
