"""Tokenizing rendered prompts, and the cut at the end of the tool group; the tokens that open an
assistant turn, where the engine cuts a prompt's chunks (`turn_opening`, engine/prefix_index.py).

The whole prompt is tokenized as one text, and the prefix is every token that ends inside the tool
group's text; never the group tokenized on its own, because BPE merges across the boundary.

Most of a prompt is the tool group, and re-tokenizing it on every request was the largest cost a
hit paid above the model's own compute (~5-13 ms for 3,000 tokens). It is done once per distinct
group text instead, by a property of fast (`tokenizers`) tokenizers: the text is split at special
added tokens (`<|im_end|>`, `<|eot_id|>`, ...) before normalization, pre-tokenization and the model
run, so the tokens before such a token do not depend on anything after it. The head (the group's
text up to the start of its last special token) is tokenized once; each request tokenizes only
`special token + rest` and appends it. A special token with lstrip/rstrip/single_word options can
change the text around it, so only tokens without them are boundaries.

Not taken on trust: the first request of each group tokenizes the whole prompt the plain way and
the split way and compares them; a group whose two results differ is always tokenized whole. Every
later request checks that its tail starts with the boundary token.

Heads are per tenant (a namespace: the tenant's cache salt). A shared head would let one tenant
time whether another had sent a system prompt + tools (a remembered head makes the request
faster). And a head is remembered only once its request is accepted (`encode_pending` + commit):
a request rejected after tokenizing (over the context, say) leaves nothing behind. Each tenant
keeps at most `max_heads_per_namespace` heads, all tenants together `max_heads`, token ids packed
as 32-bit arrays; and in bytes (the group text a head is keyed by, and its arrays: `head_bytes`)
all together at most `max_bytes` (setting `tokenizer_heads_bytes`), each tenant the same share of
it as of the count (a quarter by default). A head larger than a tenant's share is not kept.
Past the bounds in all, the tenant keeping the most heads (or bytes) forgets its oldest, so one
tenant's many groups never push out another tenant's few.
"""

from __future__ import annotations

import bisect
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.engine import Tokenizer

MAX_HEADS = 256  # distinct (tenant, tool-group text) pairs remembered in all
MAX_HEADS_PER_NAMESPACE = 64  # one tenant cannot evict every other tenant's heads
MAX_HEAD_BYTES = 128 * 1024**2  # all heads' bytes together (setting tokenizer_heads_bytes)


@dataclass(frozen=True, slots=True)
class _Head:
    split: int  # char index where the boundary token starts
    boundary_id: int
    ids: array[int]  # tokens before `split`
    ends: array[int]  # their end offsets


def _noop() -> None:
    return None


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_heads: int = MAX_HEADS,
                 max_heads_per_namespace: int = MAX_HEADS_PER_NAMESPACE, max_bytes: int = MAX_HEAD_BYTES) -> None:
        self.tokenizer = tokenizer
        self.max_heads = max_heads
        self.max_heads_per_namespace = max_heads_per_namespace
        self.max_bytes = max_bytes
        self.max_bytes_per_namespace = max_bytes * min(max_heads_per_namespace, max_heads) // max(max_heads, 1)
        self.boundaries = _boundary_tokens(tokenizer)
        # (namespace, group text) -> head; None: tokenize that group whole
        self._heads: OrderedDict[tuple[str, str], _Head | None] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # each remembered head's bytes
        self._namespace_bytes: dict[str, int] = {}
        self.num_bytes = 0  # all remembered heads' bytes
        self._lock = threading.Lock()
        self.split_uses = 0  # requests served from a cached head (for tests and metrics)

    def encode(self, text: str, prefix_chars: int, namespace: str = "") -> tuple[list[int], int]:
        """(token ids of `text`, number of them that end at or before `prefix_chars`); a group seen
        for the first time is remembered at once."""
        ids, prefix_len, commit = self.encode_pending(text, prefix_chars, namespace)
        commit()
        return ids, prefix_len

    def encode_pending(self, text: str, prefix_chars: int,
                       namespace: str = "") -> tuple[list[int], int, Callable[[], None]]:
        """As `encode`, but a newly learned head is kept only when the returned commit is called
        (once the request is accepted)."""
        if not prefix_chars or not self.boundaries:
            return (*self._whole(text, prefix_chars), _noop)
        slot = (namespace, text[:prefix_chars])
        with self._lock:
            known = slot in self._heads
            head = self._heads.get(slot)
            if known:
                self._heads.move_to_end(slot)
        if not known:
            return self._first_sight(text, prefix_chars, slot)
        if head is not None:
            split = self._split(text, prefix_chars, head)
            if split is not None:
                self.split_uses += 1
                return (*split, _noop)
        return (*self._whole(text, prefix_chars), _noop)

    def remembered(self, namespace: str = "") -> list[str]:
        """The group texts whose heads `namespace` has, oldest first."""
        with self._lock:
            return [text for ns, text in self._heads if ns == namespace]

    def _whole(self, text: str, prefix_chars: int) -> tuple[list[int], int]:
        ids, ends = self._encode(text)
        return ids, _cut(ends, prefix_chars)

    def _split(self, text: str, prefix_chars: int, head: _Head) -> tuple[list[int], int] | None:
        tail_ids, tail_ends = self._encode(text[head.split :])
        if not tail_ids or tail_ids[0] != head.boundary_id:
            return None
        ids = [*head.ids, *tail_ids]
        ends = [*head.ends, *(head.split + end for end in tail_ends)]
        return ids, _cut(ends, prefix_chars)

    def _first_sight(self, text: str, prefix_chars: int,
                     slot: tuple[str, str]) -> tuple[list[int], int, Callable[[], None]]:
        """Tokenize whole; learn the group's head only if the split way gives the same tokens."""
        ids, ends = self._encode(text)
        head = self._head_of(slot[1], ids, ends)
        if head is not None and self._split(text, prefix_chars, head) != (ids, _cut(ends, prefix_chars)):
            head = None
        return ids, _cut(ends, prefix_chars), lambda: self._remember(slot, head)

    def _remember(self, slot: tuple[str, str], head: _Head | None) -> None:
        size = head_bytes(slot[1], head)
        if size > self.max_bytes_per_namespace:
            return  # larger than a tenant's whole share: tokenized whole each time instead
        namespace = slot[0]
        with self._lock:
            if slot in self._heads:  # learned meanwhile by a twin request
                self._forget(slot)
            self._heads[slot] = head
            self._sizes[slot] = size
            self._namespace_bytes[namespace] = self._namespace_bytes.get(namespace, 0) + size
            self.num_bytes += size
            mine = [key for key in self._heads if key[0] == namespace]
            for key in mine[: max(0, len(mine) - self.max_heads_per_namespace)]:
                self._forget(key)
            for key in mine:  # oldest first, never the one just learned (it fits the share alone)
                if self._namespace_bytes[namespace] <= self.max_bytes_per_namespace:
                    break
                if key in self._heads:
                    self._forget(key)
            while len(self._heads) > self.max_heads or self.num_bytes > self.max_bytes:
                self._forget(self._oldest_of_largest(by_bytes=self.num_bytes > self.max_bytes))

    def _oldest_of_largest(self, by_bytes: bool) -> tuple[str, str]:
        """The oldest head of the tenant keeping the most heads (or bytes): a tenant that learns
        many heads evicts its own before another tenant's few."""
        counts: dict[str, int] = {}
        for namespace, _ in self._heads:
            counts[namespace] = counts.get(namespace, 0) + 1
        sizes = self._namespace_bytes if by_bytes else counts
        largest = max(sizes, key=sizes.__getitem__)
        return next(key for key in self._heads if key[0] == largest)

    def _forget(self, slot: tuple[str, str]) -> None:
        del self._heads[slot]
        size = self._sizes.pop(slot)
        self.num_bytes -= size
        left = self._namespace_bytes[slot[0]] - size
        if left:
            self._namespace_bytes[slot[0]] = left
        else:
            del self._namespace_bytes[slot[0]]

    def _head_of(self, group_text: str, ids: list[int], ends: list[int]) -> _Head | None:
        found = [(group_text.rfind(token), token) for token in self.boundaries]
        split, token = max(found, default=(-1, ""))
        if split <= 0:
            return None
        count = bisect.bisect_right(ends, split)
        if count >= len(ids) or ids[count] != self.boundaries[token] or (count and ends[count - 1] != split):
            return None
        return _Head(split, ids[count], array("i", ids[:count]), array("i", ends[:count]))

    def _encode(self, text: str) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]


def head_bytes(group_text: str, head: _Head | None) -> int:
    """What remembering a group's head keeps: its text (the key) and its two token arrays."""
    arrays = (head.ids.itemsize * len(head.ids) + head.ends.itemsize * len(head.ends)) if head is not None else 0
    return sys.getsizeof(group_text) + arrays + 256  # and the entry itself, roughly


def _cut(ends: list[int], prefix_chars: int) -> int:
    return bisect.bisect_right(ends, prefix_chars) if prefix_chars else 0


def _boundary_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Special added tokens that split the text as-is ({content: id}); none for slow tokenizers."""
    if not getattr(tokenizer, "is_fast", False):
        return {}
    out: dict[str, int] = {}
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        plain = not (getattr(token, "lstrip", True) or getattr(token, "rstrip", True)
                     or getattr(token, "single_word", True) or getattr(token, "normalized", True))
        if getattr(token, "special", False) and plain and token.content:
            out[token.content] = int(token_id)
    return out


def turn_opening(tokenizer: Tokenizer, template: str | None) -> tuple[int, ...]:
    """The tokens that open an assistant turn: the generation prompt's, up to its last non-blank
    token (ChatML's `<|im_start|>`, `assistant`; Llama 3's `<|start_header_id|>`, `assistant`,
    `<|end_header_id|>`: the blank line after it tokenizes differently once an answer follows).
    Prompt chunks are cut one token after it, past that blank (engine/prefix_index.py).
    For a template without a generation prompt (Mistral), the first special token of a rendered
    user turn that is not BOS (`[INST]`). Empty when there is none: the rest of the prompt is then
    cut every `chunk_tokens` only (reuse then stops at the last such cut before the first new
    token)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    user = [{"role": "user", "content": "x"}]
    try:
        bare = str(tokenizer.apply_chat_template(user, chat_template=template, tokenize=False,
                                                 add_generation_prompt=False))
        prompted = str(tokenizer.apply_chat_template(user, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True))
    except Exception:  # a template that cannot render one user message has no turns to find
        return ()
    generation = prompted[len(bare):] if prompted.startswith(bare) else ""
    if generation:
        ids = [int(t) for t in tokenizer(generation, add_special_tokens=False)["input_ids"]]
        while ids and not tokenizer.decode(ids[-1:]).strip():
            ids.pop()
        return tuple(ids) if ids and ids[0] in special else ()
    bos = getattr(tokenizer, "bos_token_id", None)
    for token in tokenizer(bare, add_special_tokens=False)["input_ids"]:
        if token in special and token != bos:
            return (int(token),)
    return ()
