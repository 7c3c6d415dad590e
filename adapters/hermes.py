"""ChatML with Hermes-style tool calls: Qwen2/2.5/3, SmolLM and other ChatML models."""

from __future__ import annotations

import json

from adapters.base import CallSyntax, ChatFamily, ChatMessage, ToolSpec, arguments_object

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class HermesFamily(ChatFamily):
    name = "chatml"
    tool_parser = "hermes"
    default_template = CHATML_TEMPLATE

    def tools_block(self, tools: tuple[ToolSpec, ...]) -> str:
        lines = [json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools]
        return _TOOLS_HEADER + "".join("\n" + line for line in lines) + _TOOLS_FOOTER

    def assistant_text(self, message: ChatMessage) -> str:
        parts = [message.content] if message.content else []
        for call in message.tool_calls:
            body = json.dumps({"name": call.name, "arguments": arguments_object(call.arguments)},
                              ensure_ascii=False)
            parts.append(f"<tool_call>\n{body}\n</tool_call>")
        return "\n".join(parts)

    def tool_result_text(self, message: ChatMessage) -> str:
        return f"<tool_response>\n{message.content or ''}\n</tool_response>"

    def call_opening(self, function_name: str | None) -> str:
        if function_name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '


    def call_syntax(self) -> CallSyntax:
        return CallSyntax(trigger="<tool_call>", section_open="", call_open='<tool_call>\n{"name": ',
                          name_to_args=', "arguments": ', call_close="}\n</tool_call>", separator="\n")
