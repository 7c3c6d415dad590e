"""Tokenizing rendered prompts, and the cut at the end of the tool group.

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
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_HEADS = 256  # distinct tool-group texts remembered (~100 KB each for 3,000 tokens)


@dataclass(frozen=True, slots=True)
class _Head:
    split: int  # char index where the boundary token starts
    boundary_id: int
    ids: tuple[int, ...]  # tokens before `split`
    ends: tuple[int, ...]  # their end offsets


class PromptTokenizer:
    def __init__(self, tokenizer: Any, max_heads: int = MAX_HEADS) -> None:
        self.tokenizer = tokenizer
        self.max_heads = max_heads
        self.boundaries = _boundary_tokens(tokenizer)
        self._heads: OrderedDict[str, _Head | None] = OrderedDict()  # None: tokenize that group whole
        self._lock = threading.Lock()
        self.split_uses = 0  # requests served from a cached head (for tests and metrics)

    def encode(self, text: str, prefix_chars: int) -> tuple[list[int], int]:
        """(token ids of `text`, number of them that end at or before `prefix_chars`)."""
        if not prefix_chars or not self.boundaries:
            return self._whole(text, prefix_chars)
        group_text = text[:prefix_chars]
        with self._lock:
            known = group_text in self._heads
            head = self._heads.get(group_text)
            if known:
                self._heads.move_to_end(group_text)
        if not known:
            return self._first_sight(text, prefix_chars, group_text)
        if head is not None:
            split = self._split(text, prefix_chars, head)
            if split is not None:
                self.split_uses += 1
                return split
        return self._whole(text, prefix_chars)

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

    def _first_sight(self, text: str, prefix_chars: int, group_text: str) -> tuple[list[int], int]:
        """Tokenize whole; learn the group's head only if the split way gives the same tokens."""
        ids, ends = self._encode(text)
        head = self._head_of(group_text, ids, ends)
        if head is not None and self._split(text, prefix_chars, head) != (ids, _cut(ends, prefix_chars)):
            head = None
        with self._lock:
            self._heads[group_text] = head
            while len(self._heads) > self.max_heads:
                self._heads.popitem(last=False)
        return ids, _cut(ends, prefix_chars)

    def _head_of(self, group_text: str, ids: list[int], ends: list[int]) -> _Head | None:
        found = [(group_text.rfind(token), token) for token in self.boundaries]
        split, token = max(found, default=(-1, ""))
        if split <= 0:
            return None
        count = bisect.bisect_right(ends, split)
        if count >= len(ids) or ids[count] != self.boundaries[token] or (count and ends[count - 1] != split):
            return None
        return _Head(split, ids[count], tuple(ids[:count]), tuple(ends[:count]))

    def _encode(self, text: str) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]


def _cut(ends: list[int], prefix_chars: int) -> int:
    return bisect.bisect_right(ends, prefix_chars) if prefix_chars else 0


def _boundary_tokens(tokenizer: Any) -> dict[str, int]:
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
