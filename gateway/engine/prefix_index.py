"""The prefix index: where a prompt's chunks end, and which cached KV shares the longest token
prefix with a new prompt.

## Where a prompt's chunks end (`chunk_ends`)

A function of its token ids alone, never of what is cached.

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

## The longest cached prefix

Full blocks of `block_tokens` tokens are keyed by a hash chain (sha256 of the parent's hash and
the block's token ids), with the model/tokenizer identity and the tenant's salt at the root, so a
key names a block *and everything before it*: equal hashes mean equal prefixes, and two tenants'
chains never meet. A lookup walks the new prompt's chain to the deepest block some holder has and
then compares that holder's stored token ids with the prompt's (never the hash alone); the exact
common prefix is counted token by token from there.

Two kinds of holder (engine/core.py):
- tool groups (`CacheEntry`, named and pinned in the RAM tier): a new tool list reuses the longest
  prefix of a cached group (partial tool-group reuse);
- conversation records (`Record`): the KV of a finished request's prompt after its group, kept in
  the pool by the index alone and dropped least recently used first when the pool needs blocks.

A hit's KV is copied into the new request's own blocks (one memory copy: 9 ms for 2,900 tokens
of the default model), not read in place: decode attention sums over a sequence's KV segment by
segment, so reading a third segment would change the bits of every later token. Each request keeps
the same two segments (group, own) whatever it reuses.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.kvcache.block_pool import BlockRun
from gateway.kvcache.entry import CacheEntry

H = TypeVar("H")


def chain_hashes(root: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """One hash per full block of `tokens`: sha256(parent hash, block token ids)."""
    out: list[bytes] = []
    parent = hashlib.sha256(root).digest()
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = hashlib.sha256(parent + array("q", tokens[start:start + block_tokens]).tobytes()).digest()
        out.append(parent)
    return out


class ChainIndex(Generic[H]):
    """Block hash -> the most recent holder whose tokens start with that chain."""

    def __init__(self) -> None:
        self._nodes: dict[bytes, H] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, holder: H, hashes: list[bytes]) -> None:
        for digest in hashes:
            self._nodes[digest] = holder

    def discard(self, holder: H, hashes: list[bytes]) -> None:
        for digest in hashes:
            if self._nodes.get(digest) is holder:
                del self._nodes[digest]

    def deepest(self, hashes: list[bytes]) -> tuple[H, int] | None:
        """The holder of the longest indexed chain of `hashes`, and how many blocks it covers."""
        found: tuple[H, int] | None = None
        for depth, digest in enumerate(hashes, start=1):
            holder = self._nodes.get(digest)
            if holder is None:
                break
            found = (holder, depth)
        return found


def verified_prefix(stored: Sequence[int], tokens: Sequence[int], blocks: int, block_tokens: int) -> int:
    """The common prefix of a holder's `stored` tokens and `tokens`, when the first `blocks` blocks
    really are equal (else 0: a hash collision is a miss)."""
    matched = blocks * block_tokens
    if list(stored[:matched]) != list(tokens[:matched]):
        return 0
    return common_prefix(stored, tokens, matched)


@dataclass(eq=False, slots=True)
class Record:
    """A finished request's prompt KV after its tool group: tokens `[group_len, len(tokens))` in
    `run` (prefilled, never decoded), for the next turn of its conversation."""

    tokens: tuple[int, ...]
    group_len: int
    ends: frozenset[int]  # where its chunks ended (prefix_index.chunk_ends of its tokens)
    run: BlockRun
    hashes: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return self.run.count


MAX_RECORD_BYTES = 64 * 1024**2  # the records' tokens and chains, beside the pool blocks they hold
_TOKEN_BYTES = 40  # a tuple slot and an int object (ids past 256 are objects of their own)
_HASH_BYTES = 200  # a 32-byte digest object, its list slot and its node in the index
_RECORD_OVERHEAD_BYTES = 400


def record_bytes(record: Record) -> int:
    """What a record holds in Python (its blocks are the pool's): its whole prompt's token ids
    and block chain, though its run holds only the blocks after the group."""
    return len(record.tokens) * _TOKEN_BYTES + len(record.hashes) * _HASH_BYTES + _RECORD_OVERHEAD_BYTES


class Conversations:
    """Conversation records: indexed by their hash chains, least recently used first. The pool
    bounds their blocks; `max_bytes` bounds what they hold beside them (a record of one block
    keeps its whole prompt's ids and chain: many long prompts with short own parts held far more
    than their blocks), the least recently used going first."""

    def __init__(self, block_tokens: int, max_bytes: int = MAX_RECORD_BYTES) -> None:
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self._index: ChainIndex[Record] = ChainIndex()
        self._records: OrderedDict[int, Record] = OrderedDict()  # id(record) -> record, oldest first
        self.num_blocks = 0
        self.num_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    def find(self, tokens: Sequence[int], hashes: list[bytes]) -> tuple[Record, int] | None:
        """The record sharing the longest prefix with `tokens`, and that prefix's length."""
        found = self._index.deepest(hashes)
        if found is None:
            return None
        record, blocks = found
        common = verified_prefix(record.tokens, tokens, blocks, self.block_tokens)
        if not common:
            return None
        self._records.move_to_end(id(record))
        return record, common

    def find_turn(self, prompt: Sequence[int], group_len: int, ends: list[int],
                  chain: list[bytes]) -> tuple[Record | None, int]:
        """The record to start `prompt` from and the position its KV is used up to (a chunk end of
        both, past the group: chunks.reuse_end), or (None, group_len)."""
        found = self.find(prompt, chain)
        if found is None:
            return None, group_len
        record, common = found
        upto = reuse_end(ends, record.ends, common, len(record.tokens), len(prompt), group_len)
        return (record, upto) if upto > group_len else (None, group_len)

    def add(self, record: Record, replaces: Record | None = None) -> None:
        """Keep `record` (it holds one reference to its run). A record it covers whole (the one its
        request copied from, or an equal prompt's) goes: nothing could reuse more of it."""
        found = self._index.deepest(record.hashes)
        for old in {id(r): r for r in (replaces, found[0] if found else None) if r is not None}.values():
            if id(old) in self._records and record.tokens[:len(old.tokens)] == old.tokens:
                self._drop(old)
        self._records[id(record)] = record
        self._index.add(record, record.hashes)
        self.num_blocks += record.num_blocks
        self.num_bytes += record_bytes(record)
        while self.num_bytes > self.max_bytes and len(self._records) > 1:
            self.evict_oldest()

    def evict_oldest(self) -> bool:
        """Drop the least recently used record, giving its blocks back; False when none is left."""
        if not self._records:
            return False
        self._drop(next(iter(self._records.values())))
        self.evictions += 1
        return True

    def clear(self) -> int:
        count = len(self._records)
        for record in list(self._records.values()):
            self._drop(record)
        return count

    def records(self) -> list[Record]:
        return list(self._records.values())

    def _drop(self, record: Record) -> None:
        del self._records[id(record)]
        self._index.discard(record, record.hashes)
        self.num_blocks -= record.num_blocks
        self.num_bytes -= record_bytes(record)
        record.run.release()


class GroupIndex:
    """Cached tool groups by their block chains, for a tool list that is not cached: the cached
    group (in RAM) with the longest common prefix, used up to the last multiple of the chunk size
    inside it (where group chunks end). Holds no blocks: an entry the RAM tier let go is skipped
    (its blocks may be someone else's by now) and forgotten."""

    def __init__(self, block_tokens: int, chunk_tokens: int, kept: Callable[[CacheEntry], bool]) -> None:
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self._kept = kept
        self._index: ChainIndex[CacheEntry] = ChainIndex()
        self._chains: dict[int, tuple[CacheEntry, list[bytes]]] = {}  # id(entry) -> its chain

    def add(self, entry: CacheEntry, root: bytes) -> None:
        for held, _ in list(self._chains.values()):  # forget groups the RAM tier let go
            if not self._kept(held):
                self._forget(held)
        chain = chain_hashes(root, entry.key.token_ids, self.block_tokens)
        self._index.add(entry, chain)
        self._chains[id(entry)] = (entry, chain)

    def longest(self, root: bytes, group: Sequence[int]) -> tuple[CacheEntry | None, int]:
        """The entry to start `group` from and how many of its tokens to copy, or (None, 0)."""
        found = self._index.deepest(chain_hashes(root, group, self.block_tokens))
        if found is None:
            return None, 0
        entry, blocks = found
        if entry.blocks is None or not self._kept(entry):
            self._forget(entry)
            return None, 0
        common = verified_prefix(entry.key.token_ids, group, blocks, self.block_tokens)
        upto = min(common, entry.num_tokens, len(group) - 1) // self.chunk_tokens * self.chunk_tokens
        return (entry, upto) if upto > 0 else (None, 0)

    def _forget(self, entry: CacheEntry) -> None:
        held = self._chains.pop(id(entry), None)
        if held is not None:
            self._index.discard(entry, held[1])


# ---- where a prompt's chunks end -------------------------------------------------------------

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
