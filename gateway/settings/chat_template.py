"""The `chat_template` setting (vLLM's `--chat-template`) read into template text: a Jinja file's
path, or the template itself. vLLM's rule tells them apart: text holding `{`, `}` or a newline is
a template (its backslash escapes decoded, so `\\n` typed in a shell is a newline), anything else
a path. The text is parsed once here, so a template with a syntax error stops start-up naming
its line instead of failing every request."""

from __future__ import annotations

from pathlib import Path

from gateway.settings.parts import SettingsError

_TEMPLATE_CHARS = "{}\n"


def read_chat_template(value: str) -> str:
    """The template text `value` names; SettingsError naming the file or the syntax error."""
    text = _inline(value) if any(char in value for char in _TEMPLATE_CHARS) else _file_text(value)
    _check_syntax(text, value)
    return text


def describe_chat_template(value: str) -> str:
    """How `toolkv config` shows the setting: a path as given, a template by its length."""
    if any(char in value for char in _TEMPLATE_CHARS):
        return f"<inline template, {len(value)} chars>"
    return value


def _inline(value: str) -> str:
    # backslashreplace first, so characters beyond Latin-1 survive unicode_escape unchanged
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _file_text(value: str) -> str:
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SettingsError(f"setting 'chat_template': cannot read the template file '{value}' ({reason}); give "
                            "a Jinja file's path or the template itself") from None


def _check_syntax(text: str, value: str) -> None:
    import jinja2  # lazy: transformers' template engine, needed only when a template is set

    # the extension transformers' chat templates may use
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        shown = "the inline template" if any(char in value for char in _TEMPLATE_CHARS) else f"'{value}'"
        raise SettingsError(f"setting 'chat_template': {shown} is not a Jinja template: {exc.message} "
                            f"(line {exc.lineno})") from None
