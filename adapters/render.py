"""Render a chat (system + tools + conversation + generation prompt) with the model's own template,
and mark where the tool group ends so the caller can cut the tokenized prompt there.

When the template renders tools itself, it is used as is; when it drops them (SmolLM2's does),
the family writes the tools into the system message and the tool turns into plain text.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from adapters.base import ChatFamily, ChatMessage, RenderedPrompt, ToolGroup, ToolSpec

log = logging.getLogger(__name__)

_PROBE_NAME = "toolkv_probe_function_x7"


class TemplateTokenizer(Protocol):
    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class PromptRenderer:
    def __init__(self, tokenizer: TemplateTokenizer, family: ChatFamily) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.template = tokenizer.chat_template or family.default_template
        self.native_tools = self._template_renders_tools()

    def render(self, messages: list[ChatMessage], tools: list[ToolSpec]) -> RenderedPrompt:
        system, conversation = _split_system(messages)
        group = ToolGroup.of(system, tools)
        if self.native_tools:
            head, tail, tool_dicts = self._native_messages(group, conversation)
        else:
            head, tail, tool_dicts = self._injected_messages(group, conversation)
        full = self._apply(head + tail, tool_dicts, generation_prompt=True)
        prefix = self._apply(head, tool_dicts, generation_prompt=False) if head else ""
        if prefix and not full.startswith(prefix):
            log.warning("chat template output does not start with its tool group; not caching")
            prefix = ""
        return RenderedPrompt(text=full, prefix_chars=len(prefix), group=group)

    def _native_messages(
        self, group: ToolGroup, conversation: list[ChatMessage]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]] | None]:
        head = [{"role": "system", "content": group.system}] if group.system is not None else []
        tools = [t.openai_dict() for t in group.tools] or None
        if tools and not head:
            head = [{"role": "system", "content": ""}]
        return head, [_native_dict(m) for m in conversation], tools

    def _injected_messages(
        self, group: ToolGroup, conversation: list[ChatMessage]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], None]:
        parts = [group.system] if group.system else []
        if group.tools:
            parts.append(self.family.tools_block(group.tools))
        head = [{"role": "system", "content": "\n\n".join(parts)}] if parts or group.system is not None else []
        return head, self._plain_turns(conversation), None

    def _plain_turns(self, conversation: list[ChatMessage]) -> list[dict[str, Any]]:
        turns: list[dict[str, Any]] = []
        for msg in conversation:
            if msg.role == "tool":
                text = self.family.tool_result_text(msg)
                if turns and turns[-1].get("_tool"):
                    turns[-1]["content"] += "\n" + text
                else:
                    turns.append({"role": "user", "content": text, "_tool": True})
            elif msg.role == "assistant":
                turns.append({"role": "assistant", "content": self.family.assistant_text(msg)})
            else:
                turns.append({"role": msg.role, "content": msg.content or ""})
        return [{k: v for k, v in t.items() if k != "_tool"} for t in turns]

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        return str(text)

    def _template_renders_tools(self) -> bool:
        probe = ToolSpec(name=_PROBE_NAME, description="probe", parameters={"type": "object"})
        try:
            text = self._apply([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                               [probe.openai_dict()], generation_prompt=True)
        except Exception:  # a template that rejects the probe cannot be trusted with tools
            return False
        return _PROBE_NAME in text


def _split_system(messages: list[ChatMessage]) -> tuple[str | None, list[ChatMessage]]:
    count = 0
    while count < len(messages) and messages[count].role == "system":
        count += 1
    if count == 0:
        return None, list(messages)
    system = "\n\n".join(m.content or "" for m in messages[:count])
    return system, list(messages[count:])


def _native_dict(msg: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role, "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _as_object(c.arguments)}}
            for c in msg.tool_calls
        ]
    if msg.role == "tool":
        out["tool_call_id"] = msg.tool_call_id or ""
        if msg.name:
            out["name"] = msg.name
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
