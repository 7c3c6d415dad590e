"""Logprobs on the wire: each token's bytes and text, and the engine's per-token entries
(`sampling.TokenLogprob`) in OpenAI's chat shape (`choices[i].logprobs.content`), spread over a
stream's chunks, and in the legacy completions shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`).

A chosen token's `bytes` are exactly what it adds to the answer's text, so the entries' bytes
joined decode to `content`: a special token the answer's text leaves out (`<|im_start|>` from a
random model) has `""` and no bytes, among its entry's alternatives too (so the legacy shape's
`top_logprobs`, keyed by text, holds it once). A token that is part of a character (byte-level
BPE splits `世` in three) has its raw bytes, and its `token` writes them as `\\xNN`, as OpenAI's
does.
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Iterable
from typing import Any

from gateway.engine import Tokenizer, TokenLogprob

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log probability too small to write (-inf)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenTexts:
    """Each token's UTF-8 bytes as the tokenizer's decoder writes them into text (read once per
    token, on first use) and the logprob entries built from them."""

    def __init__(self, tokenizer: Tokenizer, special_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._special = frozenset(special_ids)
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        added: str | None = self._added.get(token_id)
        if added is not None:  # added tokens are written as they are, never byte-mapped
            return added.encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id past the vocabulary (the model's padding)
            return b""
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece writes a space as `▁`

    def content(self, entries: Iterable[TokenLogprob], keep_ids: frozenset[int]) -> list[dict[str, Any]]:
        """`entries` as `logprobs.content` items; `keep_ids`: special tokens the answer's text keeps."""
        hidden = self._special - keep_ids
        return [{**_item(self._written(e.token_id, hidden), e.logprob),
                 # the chosen token reads the same among the alternatives (its own entry's text);
                 # the others as the tokenizer writes them, hidden special tokens included
                 "top_logprobs": [_item(self._written(i, hidden) if i == e.token_id else self.bytes_of(i), lp)
                                  for i, lp in e.top]} for e in entries]

    def _written(self, token_id: int, hidden: frozenset[int]) -> bytes:
        """What the chosen `token_id` adds to the answer's text."""
        return b"" if token_id in hidden else self.bytes_of(token_id)


class StreamLogprobs:
    """A stream's logprobs not yet sent. Each chunk takes the entries of the tokens sampled since
    the previous chunk that took any: text a parser holds back (a possible tool call's opening)
    goes out later, and its tokens' logprobs with it. None (`null`) when there are none or the
    request did not ask."""

    def __init__(self, texts: TokenTexts | None, keep_ids: frozenset[int]) -> None:
        self._texts = texts
        self._keep_ids = keep_ids
        self._pending: list[TokenLogprob] = []

    def add(self, entries: Iterable[TokenLogprob]) -> None:
        if self._texts is not None:
            self._pending.extend(entries)

    def take(self) -> list[dict[str, Any]] | None:
        if self._texts is None or not self._pending:
            return None
        content = self._texts.content(self._pending, self._keep_ids)
        self._pending.clear()
        return content


class LegacyLogprobs:
    """Chat logprobs in the legacy completions shape, over one answer (whole or chunk by chunk):
    `text_offset` counts the characters of the answer before each token."""

    def __init__(self, asked: bool) -> None:
        self._asked = asked
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._chars = 0

    def shape(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """Chat-shaped entries (None: no tokens) in this shape; None when not asked for."""
        if not self._asked:
            return None
        content = entries or []
        offsets = []
        for entry in content:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(bytes(entry["bytes"])))
        return {"tokens": [e["token"] for e in content],
                "token_logprobs": [e["logprob"] for e in content],
                # the top alternatives and, as OpenAI's, always the chosen token (up to logprobs + 1)
                "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                                 for e in content],
                "text_offset": offsets}


def _item(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": raw.decode("utf-8", errors="backslashreplace"),
            "logprob": logprob if math.isfinite(logprob) else LOGPROB_FLOOR, "bytes": list(raw)}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """True for a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's): its pieces are
    bytes mapped to printable characters."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()  # its JSON, nested or not


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character map, reversed: printable bytes stand for themselves, the rest
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
