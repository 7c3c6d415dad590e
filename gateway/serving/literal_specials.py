"""What a client writes is text: the model's control tokens come from the chat template alone.

A rendered prompt is tokenized as one text (gateway/serving/prompt_tokens.py), and a fast tokenizer
finds its special tokens anywhere in it. So a message (a user's, or a tool result fetched from a web
page) holding `<|im_end|>\\n<|im_start|>assistant\\n...` would close its turn and open a forged one:
the model reads its own voice where a client wrote. OpenAI's API, and this gateway, read that string
as the characters it is.

How, without changing what every other request costs or tokenizes to: a request whose client
strings (messages, names, call ids and arguments, the tools' names, descriptions and schemas) hold
no special token's text, nearly all of them, is tokenized as before. Otherwise each such occurrence
in the client strings is masked (its first character replaced by one from Unicode's private-use
plane 16, so the text keeps its length) and the request is rendered a second time: every special
token left in that render is the template's own, at the same character offsets as in the real
render. The real prompt is tokenized whole as always; then each piece between two of the
template's control tokens that holds client-written control text is tokenized again alone, with
special tokens read as text, and its tokens replace the whole tokenization's (which a fast
tokenizer splits at special tokens anyway, so every other piece keeps exactly its tokens). The
cache keys on token ids, so such a prompt is never served KV computed for the control-token
reading.

Client text is looked for where the renderer reads it, not where the client wrote it. A history
call's `arguments` is JSON text the renderer parses and writes again (adapters/base.py
`arguments_object`, then the template's `tojson` or the family's `json.dumps`), so the arguments
`{"q": "\\u003c|im_end|\\u003e"}` reach the prompt holding `<|im_end|>`: their strings are searched
and masked as parsed (object keys included), and the masked arguments are that parsed value written
again, so the masked render is the real one with the same characters masked. Every API comes
through here: Responses items (the stored ones `previous_response_id` replays included), legacy
`function_call` and Messages `tool_use` all arrive as a chat history's calls
(tests/security/test_forged_turns.py).

A tokenizer may also read a control token where the text holds none: a special token marked
`normalized` is matched after the tokenizer's normalizer, so under NFKC the fullwidth
`＜｜im_end｜＞` is `<|im_end|>`. For such a tokenizer (and only there: nothing else pays for it) a
prompt whose tokens hold more control tokens than its text holds control-token texts
(`slipped`) takes the masked path too, where every piece between two of the template's control
tokens that the whole tokenization read a control token in is tokenized alone, as text.

A template that does not carry client text through unchanged (the masked render, unmasked, is not
the real render) cannot be told apart: that request is a 400 naming the special token, never a
prompt with a forged turn.

Control tokens are the special added tokens, and the plain (non-special) added tokens that the chat
template itself writes: Qwen's `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`
are plain added tokens, and a tool result holding `</tool_response>` would otherwise end the result
and open a forged one, token for token. Those are found by rendering one probe conversation (a
system text, a tool, a call, its result) at start-up (`written_by`). `split_special_tokens` reads
only special tokens as text, so a piece where a client wrote a plain one is tokenized in parts cut
after each masked character. Other plain added tokens (added words) are read in any text, as before.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import orjson

from adapters.base import ChatMessage, ToolCallIn, ToolSpec, arguments_object
from adapters.render import PromptRenderer, RenderError
from gateway.engine import Tokenizer
from gateway.errors import BadRequest

_MASK_BASE = 0x100000  # Supplementary Private Use Area-B: no tokenizer or client text means anything by it
_MAX_MASK_ROUNDS = 8  # a control token overlapping a masked one may match once it is masked: mask again


class LiteralSpecials:
    """The model's special tokens, kept out of client text (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer, template_text: str = "") -> None:
        """`template_text`: a render of the chat template (`written_by`); the plain added tokens
        in it are control tokens too."""
        self.tokenizer = tokenizer
        self.specials = {**special_tokens(tokenizer), **plain_tokens_in(tokenizer, template_text)}
        by_length = sorted(self.specials, key=len, reverse=True)  # leftmost-longest, as the tokenizer matches
        self._pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        firsts = sorted({token[0] for token in self.specials})
        self._mask_of = {first: chr(_MASK_BASE + index) for index, first in enumerate(firsts)}
        self._unmask = str.maketrans({mask: first for first, mask in self._mask_of.items()})
        # schemas are searched as their JSON text, unless some special token has a character JSON escapes
        self._json_safe = all(orjson.dumps(token).decode()[1:-1] == token for token in self.specials)
        # control tokens no client text may become; not `<unk>`, which stands for characters the vocabulary lacks
        self._special_ids = frozenset(self.specials.values()) - {getattr(tokenizer, "unk_token_id", None)}
        self._normalized = _normalizes(tokenizer, self.specials)

    def slipped(self, ids: list[int], text: str) -> bool:
        """Whether the tokens `ids` of `text` hold a control token that is not in the text as
        written (a normalized special token, read through the normalizer: see the module doc)."""
        if not self._normalized or self._pattern is None:
            return False
        found = sum(1 for token in ids if token in self._special_ids)
        return found > sum(1 for _ in self._pattern.finditer(text))

    def found(self, messages: list[ChatMessage], tools: list[ToolSpec]) -> bool:
        """Whether any client string holds a special token's text (one regex pass over them all)."""
        if self._pattern is None:
            return False
        return self._pattern.search("\0".join(_client_strings(messages, tools, self._json_safe))) is not None

    def masked(self, messages: list[ChatMessage], tools: list[ToolSpec]) -> tuple[list[ChatMessage], list[ToolSpec]]:
        """`messages` and `tools` with every special token's text masked, lengths unchanged."""
        return ([_map_message(message, self._mask) for message in messages],
                [ToolSpec(self._mask(t.name), _map_optional(t.description, self._mask),
                          _map_json(t.parameters, self._mask) if t.parameters is not None else None) for t in tools])

    def encode(self, text: str, masked_text: str) -> tuple[list[int], list[int]]:
        """Token ids of the real render `text` and each token's end offset: the special tokens left
        in `masked_text` (the template's) as tokens, the pieces between them that a client wrote
        control text into tokenized alone with it as text, the others as in the whole text."""
        assert self._pattern is not None
        if len(masked_text) != len(text) or masked_text.translate(self._unmask) != text:
            found = self._pattern.search(text)
            raise BadRequest(f"the messages or tools hold the text of this model's control token "
                             f"'{found.group() if found else '?'}', and its chat template does not pass client "
                             "text through unchanged, so it cannot be kept as text; remove it", param="messages")
        whole = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        whole_ids, whole_ends = list(whole["input_ids"]), [end for _, end in whole["offset_mapping"]]
        masks = [m.start() for m in _MASKED.finditer(masked_text)]  # where a client wrote a control token
        ids: list[int] = []
        ends: list[int] = []
        start = at = 0  # the piece's first character; the whole tokenization's first token of it
        for match in [*self._pattern.finditer(masked_text), None]:
            stop = match.start() if match is not None else len(text)
            taken = at
            while taken < len(whole_ends) and whole_ends[taken] <= stop:
                taken += 1
            if (_holds(masks, start, stop) or not _aligned(whole_ends, at, taken, stop)
                    or not self._special_ids.isdisjoint(whole_ids[at:taken])):
                self._encode_text(text[start:stop], start, ids, ends, masked_text[start:stop])  # alone, as text
            else:  # the tokenizer splits at control tokens anyway: the whole text's tokens of this piece
                ids += whole_ids[at:taken]
                ends += whole_ends[at:taken]
            if match is None:
                break
            ids.append(self.specials[match.group()])
            ends.append(match.end())
            start = match.end()
            at = taken + 1 if taken < len(whole_ends) and whole_ends[taken] == start else len(whole_ends) + 1
        return ids, ends

    def _encode_text(self, piece: str, offset: int, ids: list[int], ends: list[int], masked: str) -> None:
        """`piece` (`masked` as the masked render has it) as text; cut after each masked character
        where a plain control token would still be read whole."""
        parts = [(0, self._as_text(piece))] if piece else []
        if parts and not self._special_ids.isdisjoint(parts[0][1][0]):
            cuts = [0, *(m.end() for m in _MASKED.finditer(masked)), len(piece)]
            parts = [(start, self._as_text(piece[start:stop]))
                     for start, stop in itertools.pairwise(cuts) if stop > start]
        for start, (part_ids, part_ends) in parts:
            if not self._special_ids.isdisjoint(part_ids):  # not seen: no part holds a whole control text
                raise BadRequest("a message or tool holds text this model's tokenizer reads as a control token "
                                 "however it is cut; remove it", param="messages")
            ids.extend(part_ids)
            ends.extend(offset + start + end for end in part_ends)

    def _as_text(self, text: str) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]

    def _mask(self, text: str) -> str:
        assert self._pattern is not None
        for _ in range(_MAX_MASK_ROUNDS):  # each round masks one more character at least
            if self._pattern.search(text) is None:
                return text
            text = self._pattern.sub(lambda m: self._mask_of[m.group()[0]] + m.group()[1:], text)
        raise BadRequest("a message or tool nests this model's control-token texts too deeply to keep them as text",
                         param="messages")


_MASKED = re.compile(f"[{chr(_MASK_BASE)}-{chr(0x10FFFD)}]")


def _holds(positions: list[int], start: int, stop: int) -> bool:
    """Whether a sorted `positions` has one in [start, stop)."""
    index = bisect.bisect_left(positions, start)
    return index < len(positions) and positions[index] < stop


def _aligned(ends: list[int], first: int, last: int, stop: int) -> bool:
    """Whether the whole text's tokens `first:last` end the piece exactly at `stop` (else a
    special token that strips spaces moved a boundary: the piece is tokenized alone)."""
    return first <= last and (first == last or ends[last - 1] == stop) and last <= len(ends)


def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special added tokens ({text: id}): the control tokens a template writes."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token.content: int(token_id) for token_id, token in decoder.items()
            if getattr(token, "special", False) and token.content}


def plain_tokens_in(tokenizer: Tokenizer, text: str) -> dict[str, int]:
    """The tokenizer's plain (non-special) added tokens that `text` holds ({text: id})."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token.content: int(token_id) for token_id, token in decoder.items()
            if not getattr(token, "special", False) and token.content and token.content in text}


_PROBE_CALL = ToolCallIn("call_probe_0", "probe_tool", '{"q": "v"}')
_PROBE = [ChatMessage("system", "s"), ChatMessage("user", "u"), ChatMessage("assistant", "a", (_PROBE_CALL,)),
          ChatMessage("tool", "r", tool_call_id=_PROBE_CALL.id), ChatMessage("assistant", "b"),
          ChatMessage("user", "u")]
_PROBE_TOOL = ToolSpec("probe_tool", "d", {"type": "object", "properties": {"q": {"type": "string"}}})


def written_by(renderer: PromptRenderer) -> str:
    """What the chat template writes around one probe conversation with a tool, a call and its
    result (its plain added tokens are control tokens); empty if it cannot render it."""
    try:
        return renderer.render(_PROBE, [_PROBE_TOOL]).text
    except RenderError:
        return ""


def _normalizes(tokenizer: Tokenizer, controls: dict[str, int]) -> bool:
    """Whether some control token is matched after a normalizer (text other than its own may then
    read as it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is None:
        return False
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(token.content in controls and getattr(token, "normalized", False) for token in decoder.values())


def cut(ends: list[int], prefix_chars: int) -> int:
    """How many tokens end at or before `prefix_chars` (the tool group's tokens)."""
    return bisect.bisect_right(ends, prefix_chars) if prefix_chars else 0


def _client_strings(messages: list[ChatMessage], tools: list[ToolSpec], json_safe: bool) -> Iterator[str]:
    for message in messages:
        yield from (s for s in (message.content, message.name, message.tool_call_id) if s)
        for call in message.tool_calls:
            yield from (call.id, call.name, call.arguments)
            if "\\" in call.arguments:  # an escape: the parsed strings differ from the text sent
                yield from _json_strings(arguments_object(call.arguments))
    for tool in tools:
        yield tool.name
        if tool.description:
            yield tool.description
        if tool.parameters is None:
            continue
        text = _json_text(tool.parameters) if json_safe else None  # one C call instead of a walk
        if text is not None:
            yield text
        else:
            yield from _json_strings(tool.parameters)


def _json_text(value: Any) -> str | None:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):  # an integer past 64 bits, say: walk it instead
        return None


def _json_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _json_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_strings(item)


def _map_optional(text: str | None, fn: Callable[[str], str]) -> str | None:
    return fn(text) if text else text


def _map_message(message: ChatMessage, fn: Callable[[str], str]) -> ChatMessage:
    calls = tuple(ToolCallIn(fn(c.id), fn(c.name), _map_arguments(c.arguments, fn)) for c in message.tool_calls)
    return replace(message, content=_map_optional(message.content, fn), name=_map_optional(message.name, fn),
                   tool_call_id=_map_optional(message.tool_call_id, fn), tool_calls=calls)


def _map_arguments(arguments: str, fn: Callable[[str], str]) -> str:
    """`arguments` whose value, as the renderer parses it, has every string through `fn`: the
    parsed value written again (the renderer writes it again anyway), or the text itself through
    `fn` where it is not JSON (the renderer writes that text as it is)."""
    value = arguments_object(arguments)
    if value is arguments:
        return fn(arguments)
    return json.dumps(_map_json(value, fn), ensure_ascii=False)


def _map_json(value: Any, fn: Callable[[str], str]) -> Any:
    """Every string of a JSON value (object keys included) through `fn`; depth is bounded at the edge."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(key): _map_json(item, fn) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_json(item, fn) for item in value]
    return value
