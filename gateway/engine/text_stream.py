"""The text a sequence's tokens write: deltas that are final (whole characters, never the start
of a stop sequence that may still match), and the logprobs of each token held until its text is
sent."""

from __future__ import annotations

from typing import Protocol

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
    `stopped_by` is that sequence (the first in the text; of two at one place, the first listed)."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...],
                 special_ids: frozenset[int] = frozenset(), keep_ids: frozenset[int] = frozenset()) -> None:
        self.decoder = decoder
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted_chars = 0
        self.text_chars = 0  # where the text written so far ends (see _written_chars)
        self.stopped = False
        self.stopped_by: str | None = None
        # Special tokens are dropped from the text, except the family's tool-call markers (a
        # Mistral model writes `[TOOL_CALLS]` as one special token, and the parser needs it).
        self.keep_ids = keep_ids
        self.hidden_ids = special_ids - keep_ids
        self._visible: list[int] = []

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if token_id not in self.hidden_ids:
            self._visible.append(token_id)
        text = self._text()
        self.text_chars = _written_chars(text)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
            return self._take(text, end)
        return self._take(text, len(text) - self.holdback)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._text()
        return self._take(text, len(text))

    def _text(self) -> str:
        if not self.keep_ids:
            return self.decoder.decode(self.token_ids, skip_special_tokens=True)
        return self.decoder.decode(self._visible, skip_special_tokens=False)

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.emitted_chars - self.holdback)
        hits = [(i, n) for n, i in enumerate(text.find(s, start) for s in self.stop) if i >= 0]
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
