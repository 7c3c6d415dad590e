"""Render a chat (system + tools + conversation + generation prompt) with the model's own template,
and mark where the tool group ends so the caller can cut the tokenized prompt there.

Which template: the model's own when it renders tools with the tool group at the head; else the
family's own template when it has one (Mistral: the model's template puts tools before the last
user message); else the model's template with the family's tools block written into the system
message and tool turns as plain text (SmolLM2's template drops tools).

Where the tool group ends: the head (system + tools) rendered alone, when that is a prefix of the
prompt; else everything before the first user message's text (Llama 3.1 writes tools into the
first user turn). Either way the cut must hold every tool name and the system text, or nothing is
cached.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from adapters.base import ChatFamily, ChatMessage, RenderedPrompt, ToolGroup, ToolSpec, arguments_object

log = logging.getLogger(__name__)

_PROBE_NAME = "toolkv_probe_function_x7"
_PROBE_SYSTEM = "toolkv probe system text"
_SENTINEL = "toolkv_first_user_text_q4"

# Two user turns: a template that writes tools before the *last* user message shows it here.
_PROBE_TURNS = [ChatMessage(role="user", content="u1"), ChatMessage(role="assistant", content="a1"),
                ChatMessage(role="user", content="u2")]

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


class RenderError(ValueError):
    """The chat template cannot render these messages; the message says why."""


class TemplateTokenizer(Protocol):
    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class PromptRenderer:
    def __init__(self, tokenizer: TemplateTokenizer, family: ChatFamily) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.template = tokenizer.chat_template or family.default_template
        self.native_tools = self._template_renders_tools()
        if family.tools_template and not (self.native_tools and self._keeps_group_at_head()):
            self.template, self.native_tools = family.tools_template, True
        self._warned = False

    def render(self, messages: list[ChatMessage], tools: list[ToolSpec]) -> RenderedPrompt:
        system, conversation = _split_system(messages)
        group = ToolGroup.of(system, tools)
        head, tool_dicts, full = self._render_full(group, conversation)
        prefix = self._find_prefix(head, tool_dicts, group, full)
        if head and not prefix and not self._warned:
            log.warning("the chat template does not keep the tool group at the head; not caching")
            self._warned = True
        return RenderedPrompt(text=full, prefix_chars=len(prefix), group=group)

    # ---- messages for the template ---------------------------------------------------------

    def _messages(self, group: ToolGroup, conversation: list[ChatMessage],
                  calls_as_text: bool = False) -> tuple[Messages, Messages, Tools]:
        if not self.native_tools:
            return self._injected_head(group), self._plain_turns(conversation), None
        head = [{"role": "system", "content": group.system}] if group.system is not None else []
        tools = [t.openai_dict() for t in group.tools] or None
        if tools and not head:
            head = [{"role": "system", "content": ""}]
        return head, [self._native_dict(m, calls_as_text) for m in conversation], tools

    def _injected_head(self, group: ToolGroup) -> Messages:
        parts = [group.system] if group.system else []
        if group.tools:
            parts.append(self.family.tools_block(group.tools))
        return [{"role": "system", "content": "\n\n".join(parts)}] if parts or group.system is not None else []

    def _plain_turns(self, conversation: list[ChatMessage]) -> Messages:
        turns: list[dict[str, Any]] = []
        for msg in conversation:
            if msg.role == "tool":
                text = self.family.tool_result_text(msg)
                if turns and turns[-1].get("_tool"):
                    turns[-1]["content"] += "\n" + text
                else:
                    turns.append({"role": self.family.tool_result_role, "content": text, "_tool": True})
            elif msg.role == "assistant":
                turns.append({"role": "assistant", "content": self.family.assistant_text(msg)})
            else:
                turns.append({"role": msg.role, "content": msg.content or ""})
        return [{k: v for k, v in t.items() if k != "_tool"} for t in turns]

    def _native_dict(self, msg: ChatMessage, calls_as_text: bool) -> dict[str, Any]:
        if calls_as_text and msg.tool_calls:
            return {"role": "assistant", "content": self.family.assistant_text(msg)}
        return _native_dict(msg)

    # ---- rendering -------------------------------------------------------------------------

    def _render_full(self, group: ToolGroup, conversation: list[ChatMessage]) -> tuple[Messages, Tools, str]:
        """The whole prompt. A template that refuses the calls of a history turn (Llama 3.1 takes
        one call per turn) gets them as text, written as the model writes them."""
        attempts = [False, True] if self.native_tools and any(m.tool_calls for m in conversation) else [False]
        errors: list[Exception] = []
        for calls_as_text in attempts:
            head, tail, tools = self._messages(group, conversation, calls_as_text)
            try:
                return head, tools, self._apply(head + tail, tools, generation_prompt=True)
            except Exception as exc:  # jinja's TemplateError, or whatever else a template raises
                errors.append(exc)
        raise RenderError(f"the model's chat template cannot render these messages: {errors[0]}") from errors[0]

    def _find_prefix(self, head: Messages, tools: Tools, group: ToolGroup, full: str) -> str:
        if not head:
            return ""
        for cut in (self._head_alone, self._before_first_user_text):
            prefix = cut(head, tools)
            if prefix and full.startswith(prefix) and _holds_group(prefix, group):
                return prefix
        return ""

    def _head_alone(self, head: Messages, tools: Tools) -> str:
        try:
            return self._apply(head, tools, generation_prompt=False)
        except Exception:  # Llama 3.1 refuses tools without a user message
            return ""

    def _before_first_user_text(self, head: Messages, tools: Tools) -> str:
        try:
            text = self._apply(head + [{"role": "user", "content": _SENTINEL}], tools, generation_prompt=False)
        except Exception:
            return ""
        at = text.find(_SENTINEL)
        return text[:at] if at > 0 else ""

    def _apply(self, messages: Messages, tools: Tools, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        return str(text)

    # ---- probing the template once ---------------------------------------------------------

    def _template_renders_tools(self) -> bool:
        probe = ToolSpec(name=_PROBE_NAME, description="probe", parameters={"type": "object"})
        try:
            text = self._apply([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                               [probe.openai_dict()], generation_prompt=True)
        except Exception:  # a template that rejects the probe cannot be trusted with tools
            return False
        return _PROBE_NAME in text

    def _keeps_group_at_head(self) -> bool:
        probe = ToolSpec(name=_PROBE_NAME, description="probe", parameters={"type": "object"})
        group = ToolGroup.of(_PROBE_SYSTEM, [probe])
        try:
            head, tools, full = self._render_full(group, _PROBE_TURNS)
        except RenderError:
            return False
        return bool(self._find_prefix(head, tools, group, full))


def _holds_group(prefix: str, group: ToolGroup) -> bool:
    """Every tool name and the system text appear in the cut, as written or as a template's
    `tojson` writes them (escaped, with or without non-ASCII as \\u escapes)."""
    return (all(_appears(name, prefix) for name in group.tool_names)
            and _appears((group.system or "").strip(), prefix))


def _appears(text: str, prefix: str) -> bool:
    if text in prefix:
        return True
    return any(json.dumps(text, ensure_ascii=as_ascii)[1:-1] in prefix for as_ascii in (False, True))


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
             "function": {"name": c.name, "arguments": arguments_object(c.arguments)}}
            for c in msg.tool_calls
        ]
    if msg.role == "tool":
        out["tool_call_id"] = msg.tool_call_id or ""
        if msg.name:
            out["name"] = msg.name
    return out
