"""Mistral (v3 tokenizer: 7B v0.3, Mixtral 8x22B, Nemo): `[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`,
calls as `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`, results as `[TOOL_RESULTS] {...}[/TOOL_RESULTS]`.

Mistral's own templates put the tools (and the system prompt) just before the *last* user
message, so consecutive requests share no prefix. This family's template writes the same blocks
with the tool group at the head instead: tools, then the system prompt opening the first `[INST]`.
"""

from __future__ import annotations

import json

from adapters.base import CallSyntax, ChatFamily, ChatMessage, ToolSpec, arguments_object

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{ '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '[INST] ' + (ns.system + '\\n\\n' if ns.system else '') + message['content'] + '[/INST]' }}"
    "{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id[-9:]} | tojson }}"
    "{{- ', ' if not loop.last }}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] ' + {'content': message['content'], 'call_id': message.tool_call_id[-9:]} | tojson"
    " + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


class MistralFamily(ChatFamily):
    name = "mistral"
    tool_parser = "mistral"
    default_template = MISTRAL_TEMPLATE
    tools_template = MISTRAL_TEMPLATE
    call_markers = ("[TOOL_CALLS]",)

    def tools_block(self, tools: tuple[ToolSpec, ...]) -> str:
        listing = json.dumps([t.openai_dict() for t in tools], ensure_ascii=False)
        return f"[AVAILABLE_TOOLS] {listing}[/AVAILABLE_TOOLS]"

    def assistant_text(self, message: ChatMessage) -> str:
        if not message.tool_calls:
            return message.content or ""
        calls = [{"name": c.name, "arguments": arguments_object(c.arguments)} for c in message.tool_calls]
        return "[TOOL_CALLS] " + json.dumps(calls, ensure_ascii=False)

    def tool_result_text(self, message: ChatMessage) -> str:
        result = {"content": message.content or "", "call_id": (message.tool_call_id or "")[-9:]}
        return f"[TOOL_RESULTS] {json.dumps(result, ensure_ascii=False)}[/TOOL_RESULTS]"

    def call_opening(self, function_name: str | None) -> str:
        if function_name is None:
            return '[TOOL_CALLS] [{"name": "'
        return '[TOOL_CALLS] [{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '

    def call_syntax(self) -> CallSyntax:
        return CallSyntax(trigger="[TOOL_CALLS]", section_open="[TOOL_CALLS] [", call_open='{"name": ',
                          name_to_args=', "arguments": ', call_close="}", separator=", ", section_close="]")
