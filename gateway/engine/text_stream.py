"""The text a sequence's tokens write: deltas that are final (whole characters, never the start
of a stop sequence that may still match), and the logprobs of each token held until its text is
sent.

A token's text is found incrementally, by the tokenizers library's `DecodeStream` (Rust: under a
microsecond a token), not by decoding every token so far again (transformers' `decode`: ~100 µs
a token at 600 tokens on the development CPU, growing with the answer, for every row of every
step: 32 rows of long answers cost more host time a step than an 8B model's decode step on an
H100). The text is the same: a stream steps through the tokens `decode` would decode, with the
same `skip_special_tokens`; a character split across tokens comes when it is complete, as before.
Tokenizers without a Rust backend, those whose `decode` cleans up spaces afterwards (a pass no
stream does), and a stream that fails ("invalid prefix") decode every token again instead.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from gateway.engine.sampling import TokenLogprob


class HeldLogprobs:
    """A sequence's token logprobs, each held until the text its token wrote has been sent: a
    delta carries the logprobs of the tokens whose text ends in it. A stop sequence cuts the
    text: the tokens that wrote some of what was sent go with the last delta, the others are
    dropped (their text never reaches the client)."""

    def __init__(self) -> None:
        self._held: list[tuple[int, int, TokenLogprob]] = []  # (text start, text end, entry)
        self._end = 0

    def hold(self, entry: TokenLogprob, text_end: int) -> None:
        self._held.append((self._end, text_end, entry))
        self._end = text_end

    def release(self, sent_chars: int | None, cut: bool = False) -> tuple[TokenLogprob, ...]:
        """Those whose text is within the first `sent_chars` characters (None: all); `cut`: those
        whose text starts there, and none is held any more."""
        if not self._held:
            return ()
        if sent_chars is None or cut:
            limit = len(self._held) if sent_chars is None else sum(
                1 for start, end, _ in self._held if start < sent_chars or end <= sent_chars)
            taken, self._held = self._held[:limit], []
        else:
            limit = next((i for i, (_, end, _) in enumerate(self._held) if end > sent_chars), len(self._held))
            taken, self._held = self._held[:limit], self._held[limit:]
        return tuple(entry for _, _, entry in taken)


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Accumulates generated tokens; yields only text that is final (complete characters, and not
    possibly the start of a stop sequence). `stopped` turns true once a stop sequence appears;
    `stopped_by` is that sequence (the first in the text; of two at one place, the first listed).

    `stop_before`: stop sequences match only in the text before it (a tool call section's
    trigger: the calls after it are held to their schemas by the grammar, and a stop sequence
    would cut them into invalid arguments); "" for none of the text. A stop sequence that runs
    into the trigger itself (`"<tool"` before `<tool_call>`) stops the text when it is found
    before the trigger is whole, which depends on how the tokens split them.
    """

    def __init__(self, decoder: Decoder, stop: tuple[str, ...],
                 special_ids: frozenset[int] = frozenset(), keep_ids: frozenset[int] = frozenset(),
                 stop_before: str | None = None) -> None:
        self.decoder = decoder
        self.stop = stop if stop_before != "" else ()
        self.stop_before = stop_before or None
        self.calls_from: int | None = None  # where the text's call section starts, once written
        self._scanned = 0  # the text searched for it so far
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.text_chars = 0  # where the text written so far ends: a character begun counts as written
        self.stopped = False
        self.stopped_by: str | None = None
        # Special tokens are dropped from the text, except the family's tool-call markers (a
        # Mistral model writes `[TOOL_CALLS]` as one special token, and the parser needs it).
        self.keep_ids = keep_ids
        self.hidden_ids = special_ids - keep_ids
        self._visible: list[int] = []
        self._backend = _stream_backend(decoder)  # None: every token decodes the whole text again
        self._stream = DecodeStream(skip_special_tokens=not keep_ids) if self._backend is not None else None
        self._text = ""  # the text of the tokens so far, whole characters only (text_chars: and one begun)
        self._anchor: int | None = None  # the last token that wrote text
        self._held: list[int] = []  # the tokens after it, that have written nothing yet

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if token_id not in self.hidden_ids:
            self._visible.append(token_id)
            self._step(token_id)
        text = self._text
        if self._pending:
            return ""  # a multi-byte character is not complete yet
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
            return self._take(text, end)
        if self.calls_from is not None:  # no stop sequence can match any more: all of it is final
            return self._take(text, len(text))
        return self._take(text, len(text) - self.holdback)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._decoded() if self._pending else self._text  # a character never completed: as decode writes it
        return self._take(text, len(text))

    def _step(self, token_id: int) -> None:
        """The text with `token_id`'s (a token the text shows: not a hidden special token)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # the stream cannot go on (e.g. "invalid prefix"): decode whole from now on
                self._stream = None
            else:
                if piece is not None:
                    self._text += piece
                    self._anchor, self._held = token_id, []
                    self.text_chars = len(self._text)
                    return
                self._held.append(token_id)  # no text yet: the token's bytes end inside a character
                written = self._written_with_held()
                if written is not None:
                    self.text_chars = written
                    return
                self._stream = None
        text = self._decoded()
        self._text = text.rstrip("\ufffd")
        self.text_chars = _written_chars(text)

    @property
    def _pending(self) -> bool:
        """The last tokens began a character that is not complete yet."""
        return self.text_chars > len(self._text)

    def _written_with_held(self) -> int | None:
        """Where the text ends with the held tokens, as decoding every token counts it: the
        stream holds them, and any whole characters they begin with (a space before an emoji's
        first bytes), until their last character is complete. Counted from the decoding of the
        last token that wrote text and them, past that token's own text (None: they do not
        decode after it)."""
        skip = not self.keep_ids
        if self._anchor is None:
            return _written_chars(self._backend.decode(self._held, skip_special_tokens=skip))
        anchor = self._backend.decode([self._anchor], skip_special_tokens=skip)
        both = self._backend.decode([self._anchor, *self._held], skip_special_tokens=skip)
        if not both.startswith(anchor):
            return None
        return len(self._text) + _written_chars(both[len(anchor):])

    def _decoded(self) -> str:
        """Every token so far, decoded at once (a character not complete yet as U+FFFD)."""
        if not self.keep_ids:
            return self.decoder.decode(self.token_ids, skip_special_tokens=True)
        return self.decoder.decode(self._visible, skip_special_tokens=False)

    def _stop_at(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, self.emitted_chars - self.holdback)
        if self.stop_before is not None and self.calls_from is None:  # a trigger may end in the new text
            at = text.find(self.stop_before, max(0, self._scanned - len(self.stop_before) + 1))
            self.calls_from, self._scanned = (at if at >= 0 else None), len(text)
        end = len(text) if self.calls_from is None else self.calls_from  # a match must end before the calls
        hits = [(i, n) for n, i in enumerate(text.find(s, start, end) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, which = min(hits)
        self.stopped_by = self.stop[which]
        return at

    def _take(self, text: str, end: int) -> str:
        if end <= self.emitted_chars:
            return ""
        delta = text[self.emitted_chars : end]
        self.emitted_chars = end
        return delta


def _written_chars(text: str) -> int:
    """Where `text` ends; a character not complete yet (decoded as U+FFFD) counts as written: the
    token that began it ends inside it, and is sent with it."""
    complete = text.rstrip("\ufffd")
    return len(complete) + (complete != text)


def _stream_backend(decoder: Decoder) -> Any:
    """The Rust tokenizer a `DecodeStream` steps with, when its text is `decoder.decode`'s: None
    for a tokenizer without one, or one whose `decode` cleans up spaces after decoding."""
    if getattr(decoder, "clean_up_tokenization_spaces", False):
        return None
    return getattr(decoder, "backend_tokenizer", None)
