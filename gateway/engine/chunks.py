"""Where a prompt's chunks end: a function of its token ids alone, never of what is cached.

This is what makes reuse exact. Floating-point results on this CPU depend on the shape of the pass
that computes them (torch's fused attention splits a chunk's queries differently by its length, and
small matrix products round differently from large ones), so a token's KV is only the same bits
in two prompts if it was computed in the same chunk, over the same earlier KV. Every prompt is
therefore cut at the same places whether it is served cold, as a hit or from an earlier turn:

- the tool group `[0, G)`: every `chunk_tokens` from 0, and G;
- the rest: one token after each place an assistant turn opens (the opening is the generation
  prompt's tokens up to its trailing blank, `<|im_start|>assistant` in ChatML,
  serving/prompt_tokens.py `turn_opening`; the token after it is that blank, `\n`), and every
  `chunk_tokens` after the last such cut (or after G);
- and the prompt's end.

A later prompt may reuse an earlier one's KV up to a position that is a chunk end in both and
within their common token prefix (`reuse_end`): the chunks before it were the same passes over the
same tokens, so the KV is bit for bit what a cold prefill computes.

Why one token after the opening, not before it: a prompt ends with its generation prompt, opening
and blank. Cut before the opening, its last chunk was those 4 tokens alone (SmolLM2's
`<|im_start|>`, `ass`, `istant`, `\n`), one more forward pass, which reads every weight: on the CPU
a hit's 3-4 new-token pass cost about a third of its TTFT. Cut after the blank, a hit's or a miss's
new tokens are one chunk, and the next turn's prompt (the same tokens, then the answer, its tool
results and a new generation prompt) reuses the whole earlier prompt and computes only what is new
in one chunk up to `chunk_tokens`: an agent's turn is one pass, not two. The answer's own KV is
recomputed: it came from decode steps, one token a pass, whose bits differ from a prefill's. Where
the blank tokenizes differently once an answer follows (it merged with the answer's first
characters), that turn's cut is not at the earlier prompt's end and the next turn reuses up to the
cut before it (less reuse, never wrong); a template whose generation prompt has no trailing blank
cuts one token into the answer, the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence


def chunk_ends(ids: Sequence[int], group_len: int, chunk_tokens: int, opening: Sequence[int]) -> list[int]:
    """The sorted positions where the prompt's chunks end (the last one is `len(ids)`)."""
    ends = list(range(chunk_tokens, group_len, chunk_tokens))
    if group_len:
        ends.append(group_len)
    anchor, width = group_len, len(opening)
    first = opening[0] if width else None
    for position in range(group_len + 1, len(ids)):
        if ids[position] == first and list(ids[position:position + width]) == list(opening):
            anchor = min(position + width + 1, len(ids))  # after the blank that follows the opening
            ends.append(anchor)
        elif position > anchor and (position - anchor) % chunk_tokens == 0:
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
