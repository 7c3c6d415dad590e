"""vLLM's `--tool-call-parser` names, mapped onto toolkv's tool-call syntaxes and the chat family
(the `adapter` setting) that writes and reads each, so a vLLM command line serves unchanged.

Only the parsers whose syntax toolkv reads exactly are mapped; any other name is refused at
start-up, naming these, rather than serving calls a parser of another syntax would miss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VllmParser:
    parser: str  # the syntax's name (a family's `tool_parser`; the tests' oracle: tests/support/toolcalls)
    adapter: str  # the chat family whose calls it reads (adapters.families.get_family)
    syntax: str  # what the calls look like, for the error that lists the choices


VLLM_TOOL_PARSERS: dict[str, VllmParser] = {
    "hermes": VllmParser("hermes", "chatml", "<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3"),
    "llama3_json": VllmParser("llama3", "llama3", "a JSON object, <|python_tag|> optional: Llama 3.1-3.3"),
    "mistral": VllmParser("mistral", "mistral", "[TOOL_CALLS][...]: Mistral"),
}


def adapter_for(adapter: str, tool_call_parser: str | None) -> str:
    """The `adapter` setting with vLLM's `--tool-call-parser` folded in; ValueError for a parser
    toolkv does not have, or one that contradicts an adapter given alongside it."""
    if tool_call_parser is None:
        return adapter
    found = VLLM_TOOL_PARSERS.get(tool_call_parser)
    if found is None:
        choices = "; ".join(f"{name} ({p.syntax})" for name, p in VLLM_TOOL_PARSERS.items())
        raise ValueError(f"tool_call_parser '{tool_call_parser}': toolkv does not read this syntax. It maps vLLM's "
                         f"parsers {choices}. Leave tool_call_parser out to let toolkv pick the family from the "
                         "model's chat template")
    if adapter not in ("auto", found.adapter):
        raise ValueError(f"tool_call_parser '{tool_call_parser}' reads the {found.adapter} family's calls, but adapter "
                         f"is '{adapter}': give one of the two")
    return found.adapter
