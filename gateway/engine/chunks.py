"""Where a prompt's chunks end: a function of its token ids alone, never of what is cached.

This is what makes reuse exact. Floating-point results on this CPU depend on the shape of the pass
that computes them (torch's fused attention splits a chunk's queries differently by its length, and
small matrix products round differently from large ones), so a token's KV is only the same bits
in two prompts if it was computed in the same chunk, over the same earlier KV. Every prompt is
therefore cut at the same places whether it is served cold, as a hit or from an earlier turn:

- the tool group `[0, G)`: every `chunk_tokens` from 0, and G;
- the rest: at every *turn marker* (the special token that opens a message, `<|im_start|>` in
  ChatML, see `turn_markers`), and every `chunk_tokens` after the last marker (or after G);
- and the prompt's end.

A later prompt may reuse an earlier one's KV up to a position that is a chunk end in both and
within their common token prefix (`reuse_end`): the chunks before it were the same passes over the
same tokens, so the KV is bit for bit what a cold prefill computes. Since every message starts at a
marker, an agent's next turn reuses everything up to the start of the assistant's last message and
computes only the messages that are new (the assistant's own answer is recomputed: its KV came from
decode steps, one token a pass, whose bits differ from a prefill's).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from typing import Any


def chunk_ends(ids: Sequence[int], group_len: int, chunk_tokens: int, markers: Collection[int]) -> list[int]:
    """The sorted positions where the prompt's chunks end (the last one is `len(ids)`)."""
    ends = list(range(chunk_tokens, group_len, chunk_tokens))
    if group_len:
        ends.append(group_len)
    anchor = group_len
    for position in range(group_len + 1, len(ids)):
        if ids[position] in markers:
            anchor = position
            ends.append(position)
        elif (position - anchor) % chunk_tokens == 0:
            ends.append(position)
    if not ends or ends[-1] != len(ids):
        ends.append(len(ids))
    return ends


def next_end(ends: list[int], computed: int) -> int:
    """The end of the chunk that starts at `computed`."""
    return ends[bisect.bisect_right(ends, computed)]


def reuse_end(new_ends: list[int], old_ends: Collection[int], common: int, old_len: int, new_len: int,
              floor: int) -> int:
    """How far a new prompt may use an old one's KV: the last position above `floor` that ends a
    chunk of both (or ends the old prompt, whose last chunk ended there), within their `common`
    token prefix and before the new prompt's end (its last token must be computed for logits).
    `floor` when there is none."""
    best = floor
    for end in new_ends[bisect.bisect_right(new_ends, floor):]:
        if end > common or end > old_len or end >= new_len:
            break
        if end in old_ends or end == old_len:
            best = end
    return best


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """The length of the common prefix of `a` and `b`, known to be at least `start`."""
    limit = min(len(a), len(b))
    at = start
    while at < limit and a[at] == b[at]:
        at += 1
    return at


def turn_markers(tokenizer: Any, template: str | None) -> frozenset[int]:
    """The special token that opens every turn: the first token of the generation prompt (ChatML's
    `<|im_start|>`, Llama 3's `<|start_header_id|>`); for a template without a generation prompt
    (Mistral), the first special token of a rendered user turn that is not BOS (`[INST]`). Empty
    when there is none: the rest of the prompt is then cut every `chunk_tokens` only (reuse then
    stops at the last such cut before the first new token)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    user = [{"role": "user", "content": "x"}]
    try:
        bare = str(tokenizer.apply_chat_template(user, chat_template=template, tokenize=False,
                                                 add_generation_prompt=False))
        prompted = str(tokenizer.apply_chat_template(user, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True))
    except Exception:  # a template that cannot render one user message has no turns to find
        return frozenset()
    opening = prompted[len(bare):] if prompted.startswith(bare) else ""
    if opening:  # the generation prompt opens a turn: its first token, if special
        first = tokenizer(opening, add_special_tokens=False)["input_ids"][:1]
        return frozenset(int(t) for t in first if t in special)
    bos = getattr(tokenizer, "bos_token_id", None)
    for token in tokenizer(bare, add_special_tokens=False)["input_ids"]:
        if token in special and token != bos:
            return frozenset({int(token)})
    return frozenset()
