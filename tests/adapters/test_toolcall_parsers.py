"""The whole-text tool-call parsers (the tests' oracle, tests/support/toolcalls/): results per
syntax, and the stream/whole-text replay invariant."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re

import pytest

from adapters.toolcalls import ContentDelta, StreamDelta, ToolCallArgsDelta, ToolCallStart
from tests.support.toolcalls import ParsedOutput, ParsedToolCall, ToolCallParser, get_parser, parser_names

HERMES = get_parser("hermes")
LLAMA3 = get_parser("llama3")
MISTRAL = get_parser("mistral")


def call(name: str, **arguments: object) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def hermes_block(name: str, args: object, raw: str | None = None) -> str:
    body = raw if raw is not None else json.dumps({"name": name, "arguments": args})
    return f"<tool_call>\n{body}\n</tool_call>"


# --------------------------------------------------------------------------- replay helpers


def replay(parser: ToolCallParser, chunks: list[str]) -> tuple[list[StreamDelta], ParsedOutput]:
    """Stream ``chunks``; return the deltas and the result they spell out, checking ordering."""
    streamer = parser.streamer()
    deltas: list[StreamDelta] = []
    for chunk in chunks:
        deltas += streamer.feed(chunk)
    deltas += streamer.finish()
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text, "empty content delta"
        elif isinstance(delta, ToolCallStart):
            assert delta.index == len(names), "call indices must be 0, 1, 2... and never repeat"
            names[delta.index] = delta.name
            args[delta.index] = []
        else:
            assert isinstance(delta, ToolCallArgsDelta)
            assert delta.index in names, "arguments before their ToolCallStart"
            args[delta.index].append(delta.fragment)
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = tuple(ParsedToolCall(names[i], "".join(args[i])) for i in range(len(names)))
    assert streamer.saw_tool_call == bool(calls)
    spelled = ParsedOutput(content or None, calls, streamer.parse_failed)
    return deltas, spelled


def assert_replay_matches(parser: ToolCallParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    _, spelled = replay(parser, chunks)
    assert spelled == parser.parse(text), f"chunks={chunks!r}"


def char_split(text: str) -> list[str]:
    return list(text)


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    if rng.random() < 0.3:  # engines sometimes send empty deltas
        chunks.insert(rng.randrange(len(chunks) + 1), "")
    return chunks


_SPECIAL = r"<tool_call>|</tool_call>|<\|python_tag\|>|\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]"


def special_token_split(text: str) -> list[str]:
    """Markers arrive as one token each (tokenizers that have them as special tokens)."""
    return re.findall(_SPECIAL + r"|\s+|\w+|[^\w\s]", text) or [text]


def bpe_like_split(text: str) -> list[str]:
    """Markers arrive in pieces, e.g. ``<``, ``tool_call``, ``>``; spaces glued to words."""
    return re.findall(r"\s?\w+|\s+|[^\w\s]{1,2}", text) or [text]


# --------------------------------------------------------------------------- registry, types


def test_registry_names_and_instances() -> None:
    assert parser_names() == ("hermes", "llama3", "mistral")
    for name in parser_names():
        parser = get_parser(name)
        assert isinstance(parser, ToolCallParser)
        assert parser.name == name


def test_registry_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match="hermes, llama3, mistral"):
        get_parser("qwen")


def test_result_types_are_frozen_and_slotted() -> None:
    values = [ParsedToolCall("f", "{}"), ParsedOutput(None, (), False), ContentDelta("x"),
              ToolCallStart(0, "f"), ToolCallArgsDelta(0, "{}")]
    for value in values:
        assert not hasattr(value, "__dict__")
        field = dataclasses.fields(value)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


# --------------------------------------------------------------------------- hermes


@pytest.mark.parametrize(
    ("text", "content"),
    [("Hello there.", "Hello there."), ("  \n Hi!\n\n", "Hi!"), ("", None), (" \n\t", None),
     ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag"),
     ("stray </tool_call> closer", "stray </tool_call> closer"), ("ends with <tool_call", "ends with <tool_call")],
)
def test_hermes_plain_text(text: str, content: str | None) -> None:
    assert HERMES.parse(text) == ParsedOutput(content, (), False)


def test_hermes_single_call() -> None:
    text = hermes_block("get_weather", {"city": "Paris", "unit": "c"})
    assert HERMES.parse(text) == ParsedOutput(None, (call("get_weather", city="Paris", unit="c"),), False)


def test_hermes_text_before_and_several_calls() -> None:
    text = ("Let me check both.\n" + hermes_block("a", {"x": 1}) + "\n"
            + hermes_block("b", {"y": [1, 2]}) + "\n")
    assert HERMES.parse(text) == ParsedOutput("Let me check both.", (call("a", x=1), call("b", y=[1, 2])), False)


def test_hermes_text_between_and_after_blocks_is_content() -> None:
    text = "First\n" + hermes_block("a", {}) + "\nthen\n" + hermes_block("b", {}) + "\ndone "
    assert HERMES.parse(text) == ParsedOutput("First\n\nthen\n\ndone", (call("a"), call("b")), False)


def test_hermes_compact_block_and_missing_arguments() -> None:
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert HERMES.parse(text) == ParsedOutput(None, (call("now"),), False)


def test_hermes_unclosed_final_block_with_complete_json() -> None:
    text = hermes_block("a", {"k": 1}) + '\n<tool_call>\n{"name": "b", "arguments": {"q": "x"}}\n'
    assert HERMES.parse(text) == ParsedOutput(None, (call("a", k=1), call("b", q="x")), False)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json</tool_call>",
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n',  # truncated JSON
        "<tool_call>\n",
        "<tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1} extra"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}\nmore text without closer',
        hermes_block("good", {}) + "\n<tool_call>{broken</tool_call>",  # all-or-nothing
    ],
)
def test_hermes_unparseable_returns_raw_text(text: str) -> None:
    assert HERMES.parse(text) == ParsedOutput(text.strip(), (), True)


def test_hermes_braces_and_closing_tag_inside_strings() -> None:
    args = {"code": "if (a) { return '}'; }", "note": "say </tool_call> or <tool_call>",
            "nested": {"deep": [{"x": "}}"}, {}]}, "quote": 'he said "}"'}
    text = "Code:\n" + hermes_block("run", args)
    assert HERMES.parse(text) == ParsedOutput("Code:", (call("run", **args),), False)


def test_hermes_unicode_and_normalisation() -> None:
    raw = '{"name":"traduire","arguments":{"mot":"caf\\u00e9","emoji":"😀","zh":"你好"}}'
    parsed = HERMES.parse("Voilà — " + hermes_block("", None, raw=raw))
    assert parsed.content == "Voilà —"
    assert parsed.tool_calls == (ParsedToolCall("traduire", '{"mot": "café", "emoji": "😀", "zh": "你好"}'),)


def test_hermes_arguments_given_as_json_text() -> None:
    raw = json.dumps({"name": "f", "arguments": json.dumps({"a": [1, {"b": None}]})})
    assert HERMES.parse(hermes_block("", None, raw=raw)).tool_calls == (call("f", a=[1, {"b": None}]),)


def test_hermes_literal_newline_inside_string_is_tolerated() -> None:
    text = '<tool_call>\n{"name": "write", "arguments": {"body": "line1\nline2"}}\n</tool_call>'
    assert HERMES.parse(text).tool_calls == (call("write", body="line1\nline2"),)


# --------------------------------------------------------------------------- llama3


def test_llama3_plain_text_and_json_not_at_start() -> None:
    for text in ["The answer is 4.", 'Use {"name": "f"} like this', "  ", "<b>bold</b>", "<|python"]:
        assert LLAMA3.parse(text) == ParsedOutput(text.strip() or None, (), False)


def test_llama3_single_call_parameters_and_arguments() -> None:
    text = '\n{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert LLAMA3.parse(text) == ParsedOutput(None, (call("get_weather", city="Oslo"),), False)
    text = '{"type": "function", "name": "f", "arguments": {"n": 1}}'
    assert LLAMA3.parse(text) == ParsedOutput(None, (call("f", n=1),), False)


def test_llama3_python_tag_and_several_calls() -> None:
    text = ('<|python_tag|>{"name": "a", "parameters": {"x": "}"}}; {"name": "b", "parameters": {}}\n'
            '{"name": "c", "parameters": {"z": "é"}};')
    expected = (call("a", x="}"), call("b"), call("c", z="é"))
    assert LLAMA3.parse(text) == ParsedOutput(None, expected, False)
    tagged_each = '<|python_tag|>{"name": "a", "parameters": {}}<|python_tag|>{"name": "b", "parameters": {}}'
    assert LLAMA3.parse(tagged_each).tool_calls == (call("a"), call("b"))


@pytest.mark.parametrize(
    "text",
    ['{"name": "f", "parameters": {"a": 1}', '{"result": 42}', "{oops}",
     '{"name": "f", "parameters": {}} and then some words', "<|python_tag|>print('hi')",
     "<|python_tag|>", '{"name": "f", "parameters": {}};;{"name": "g"}'],
)
def test_llama3_unparseable_returns_raw_text(text: str) -> None:
    assert LLAMA3.parse(text) == ParsedOutput(text.strip(), (), True)


# --------------------------------------------------------------------------- mistral


def test_mistral_plain_text() -> None:
    for text in ["Bonjour !", "an [array] and [TOOL_ not a marker", ""]:
        assert MISTRAL.parse(text) == ParsedOutput(text.strip() or None, (), False)


def test_mistral_array_form() -> None:
    text = ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": "]}"}, "id": "abc123xyz"}, '
            '{"name": "b", "arguments": {}}]')
    assert MISTRAL.parse(text) == ParsedOutput(None, (call("a", x="]}"), call("b")), False)


def test_mistral_text_before_and_single_object() -> None:
    text = 'Checking.\n[TOOL_CALLS] {"name": "a", "arguments": {"k": "ü"}}\n'
    assert MISTRAL.parse(text) == ParsedOutput("Checking.", (call("a", k="ü"),), False)


def test_mistral_named_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}'
    assert MISTRAL.parse(text) == ParsedOutput(None, (call("get_weather", city="Lyon"), call("now")), False)


@pytest.mark.parametrize(
    "text",
    ["[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}", "[TOOL_CALLS] []", "[TOOL_CALLS]",
     "[TOOL_CALLS] [{\"arguments\": {}}]", "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]f[ARGS]{\"x\": ",
     "[TOOL_CALLS]f[ARGS][1]", "Hi [TOOL_CALLS] nope"],
)
def test_mistral_unparseable_returns_raw_text(text: str) -> None:
    assert MISTRAL.parse(text) == ParsedOutput(text.strip(), (), True)


# --------------------------------------------------------------------------- streaming behaviour


def test_stream_content_flows_before_finish_and_markers_are_held() -> None:
    streamer = HERMES.streamer()
    assert streamer.feed("\n Hello") == [ContentDelta("Hello")]
    assert streamer.feed(" world <tool_") == [ContentDelta(" world")]
    assert streamer.feed("call>\n") == []
    assert streamer.feed('{"name": "f", "arguments": {"a": 1}}\n</tool_call>') == []
    assert not streamer.saw_tool_call
    assert streamer.finish() == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"a": 1}')]
    assert streamer.saw_tool_call and not streamer.parse_failed
    assert streamer.finish() == []
    with pytest.raises(RuntimeError):
        streamer.feed("late")


def test_stream_false_marker_start_is_released_as_content() -> None:
    streamer = HERMES.streamer()
    assert streamer.feed("x <tool") == [ContentDelta("x")]
    assert streamer.feed("box") == [ContentDelta(" <toolbox")]
    assert streamer.finish() == []


def test_stream_failed_call_flushes_raw_text_as_content() -> None:
    streamer = HERMES.streamer()
    out = streamer.feed("Try: <tool_call>{not json") + streamer.feed("</tool_call>\n") + streamer.finish()
    assert out == [ContentDelta("Try:"), ContentDelta(" <tool_call>{not json</tool_call>")]
    assert streamer.parse_failed and not streamer.saw_tool_call


def test_llama3_stream_decides_on_first_characters() -> None:
    plain_stream = LLAMA3.streamer()
    assert plain_stream.feed("  <") == []
    assert plain_stream.feed("b>Hi") == [ContentDelta("<b>Hi")]
    call_stream = LLAMA3.streamer()
    assert call_stream.feed("<|python_") == []
    assert call_stream.feed('tag|>{"name": "f", "parameters": {}}') == []
    assert call_stream.finish() == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, "{}")]


def test_mistral_stream_content_then_calls() -> None:
    streamer = MISTRAL.streamer()
    assert streamer.feed("Ok [TOOL") == [ContentDelta("Ok")]
    assert streamer.feed('_CALLS]f[ARGS]{"a": "b"}') == []
    assert streamer.finish() == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"a": "b"}')]


# --------------------------------------------------------------------------- replay invariant

HERMES_CORPUS = [
    "", "   ", "Just text.", "  padded text \n\n", "a <tool_ b", "ends with <tool_call", "x\n<", "<tool",
    hermes_block("f", {"a": 1}),
    "Intro text.\n\n" + hermes_block("f", {"a": "x"}) + "\n" + hermes_block("g", {}) + "\n",
    "A\n" + hermes_block("f", {}) + "\nmiddle\n" + hermes_block("g", {"n": [1, {"m": 2}]}) + " tail  ",
    hermes_block("f", {"s": "}</tool_call>{ <tool_call> \"}\" é 😀 你好"}),
    '<tool_call>{"name":"f","arguments":{"x":"caf\\u00e9"}}</tool_call>',
    hermes_block("f", {}) + '\n<tool_call>\n{"name": "g", "arguments": {"k": [1]}}',
    "<tool_call>{not json</tool_call>", "Before <tool_call>{\"name\": \"f\", \"arguments\": {\"a\"",
    "  lead\n" + hermes_block("f", {}) + "\n<tool_call>{broken}</tool_call>\n  ",
    '<tool_call>{"name": "f", "arguments": {}} junk </tool_call>', "<tool_call>", "\n<tool_call>\n",
    hermes_block("f", {}) + "\n</tool_call>",
]
LLAMA3_CORPUS = [
    "", " ", "Hello!", "  <b>x</b> ", "<|python", "<|python_tag", " {", "{}", "text {\"name\": \"f\"}",
    '{"name": "f", "parameters": {"a": "}"}}',
    '\n<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"u": "ü"}}\n',
    '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {"x": [1, 2]}};',
    '{"name": "f", "parameters": {', '{"result": 1}', '<|python_tag|>print(1)',
    '{"name": "f", "parameters": {}} trailing',
]
MISTRAL_CORPUS = [
    "", "plain", " [TOOL", "[x] [TOOL_CALL", "[TOOL_CALLS]",
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "]}"}}]',
    'Sure!\n[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}] ',
    '[TOOL_CALLS]f[ARGS]{"x": "é"}[TOOL_CALLS]g[CALL_ID]abcdefghi[ARGS]{}',
    '[TOOL_CALLS] [{"name": "f"', "[TOOL_CALLS] []", 'x [TOOL_CALLS]f[ARGS]{"a": 1} after',
]
CORPORA = [(HERMES, HERMES_CORPUS), (LLAMA3, LLAMA3_CORPUS), (MISTRAL, MISTRAL_CORPUS)]
CASES = [(parser, text) for parser, corpus in CORPORA for text in corpus]
CASE_IDS = [f"{parser.name}-{i}" for i, (parser, _) in enumerate(CASES)]


@pytest.mark.parametrize(("parser", "text"), CASES, ids=CASE_IDS)
def test_replay_whole_and_char_by_char(parser: ToolCallParser, text: str) -> None:
    assert_replay_matches(parser, text, [text])
    assert_replay_matches(parser, text, char_split(text) or [""])


@pytest.mark.parametrize(("parser", "text"), CASES, ids=CASE_IDS)
def test_replay_token_like_splits(parser: ToolCallParser, text: str) -> None:
    assert_replay_matches(parser, text, special_token_split(text))
    assert_replay_matches(parser, text, bpe_like_split(text))


@pytest.mark.parametrize(("parser", "text"), CASES, ids=CASE_IDS)
def test_replay_random_splits(parser: ToolCallParser, text: str) -> None:
    rng = random.Random(f"{parser.name}:{text}")
    for _ in range(40):
        chunks = random_split(text, rng) if len(text) > 1 else [text]
        assert_replay_matches(parser, text, chunks)


_FUZZ_PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>", "<", "\n",
               '{"name": "f", "arguments": {"a": "}"}}', '{"name": "g"}', "{", "}", '"'],
    "llama3": ["<|python_tag|>", "<|python", '{"name": "f", "parameters": {"a": "}"}}', ";", "{", "}", "\n"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "[ARGS]", "f", '[{"name": "f", "arguments": {}}]',
                '{"b": "]"}', "[", "]", "\n"],
}
_FUZZ_COMMON = [" ", "  ", "Hi", "text", "é😀", "\t"]


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_replay_fuzzed_texts(name: str) -> None:
    parser = get_parser(name)
    rng = random.Random(1234)
    pieces = _FUZZ_PIECES[name] + _FUZZ_COMMON
    outcomes = set()
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        outcomes.add((bool(parser.parse(text).tool_calls), parser.parse(text).parse_failed))
        for chunks in (random_split(text, rng) if len(text) > 1 else [text], char_split(text) or [""]):
            assert_replay_matches(parser, text, chunks)
    assert outcomes == {(False, False), (True, False), (False, True)}  # every kind was exercised
