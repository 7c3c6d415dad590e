"""Llama 3.x: header-delimited turns, JSON tool calls (`{"name": ..., "parameters": ...}`), tool
results as `ipython` turns. Llama 3.1+ templates render tools themselves (into the first user
turn); the block below is used for 3.0-style templates that drop them."""

from __future__ import annotations

import json

from adapters.base import CallSyntax, ChatFamily, ChatMessage, ToolSpec, arguments_object

_TOOLS_HEADER = (
    "You have access to the following functions. To call a function, please respond with JSON for "
    'a function call. Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}. Do not use variables.\n\n"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


class Llama3Family(ChatFamily):
    name = "llama3"
    tool_parser = "llama3"
    default_template = LLAMA3_TEMPLATE
    tool_result_role = "ipython"
    call_markers = ("<|python_tag|>",)

    def tools_block(self, tools: tuple[ToolSpec, ...]) -> str:
        return _TOOLS_HEADER + "".join(json.dumps(t.openai_dict(), indent=4, ensure_ascii=False) + "\n\n"
                                       for t in tools).rstrip("\n")

    def assistant_text(self, message: ChatMessage) -> str:
        if not message.tool_calls:  # a call turn is only JSON: the parser reads text before it as no call
            return message.content or ""
        return "; ".join(
            json.dumps({"name": c.name, "parameters": arguments_object(c.arguments)}, ensure_ascii=False)
            for c in message.tool_calls)

    def tool_result_text(self, message: ChatMessage) -> str:
        return json.dumps({"output": message.content or ""}, ensure_ascii=False)

    def call_opening(self, function_name: str | None) -> str:
        if function_name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "parameters": '

    def call_syntax(self) -> CallSyntax:
        return CallSyntax(trigger='{"name"', section_open="", call_open='{"name": ', name_to_args=', "parameters": ',
                          call_close="}", separator="; ", leading_only=True)
