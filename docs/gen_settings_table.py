"""The settings reference in docs/configuration.md, generated from the declaration.

Reads `gateway.settings.Settings.model_fields` (name, default, description, section) and the
flags `toolkv serve` really takes (built by `gateway.cli.main.add_settings_arguments`, the code the
CLI runs), and renders one table per section between `<!-- settings:begin -->` and
`<!-- settings:end -->`:

    python docs/gen_settings_table.py            # print the tables
    python docs/gen_settings_table.py --write    # rewrite docs/configuration.md in place
    python docs/gen_settings_table.py --check    # exit 1 if the file is out of date (a test runs it)
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python docs/gen_settings_table.py` from anywhere
    sys.path.insert(0, str(ROOT))

from pydantic.fields import FieldInfo  # noqa: E402

from gateway.cli.main import add_settings_arguments  # noqa: E402
from gateway.settings import ENV_PREFIX, Settings, format_size, is_size, section_of  # noqa: E402

DOC = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
COMMAND = "python docs/gen_settings_table.py --write"


def cli_flags() -> dict[str, list[str]]:
    """Setting name -> its flags, as `toolkv serve` builds them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(parser)
    return {action.dest: list(action.option_strings) for action in parser._actions if action.option_strings}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    value: Any = field.default
    if value is None:
        return "unset"
    if value == ():
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and is_size(field):
        return f"`{format_size(value)}`"
    return f"`{value}`"


def _bare(annotation: Any) -> Any:
    """`X | None` -> X."""
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    return args[0] if get_origin(annotation) is not Literal and len(args) == 1 else annotation


def _description(field: FieldInfo) -> str:
    text = _cell(field.description or "")
    kind = _bare(field.annotation)
    if get_origin(kind) is Literal:
        text = text.rstrip(".") + "; values: " + ", ".join(f"`{choice}`" for choice in get_args(kind))
    return text


def _title(section: str) -> str:
    return section[:1].upper() + section[1:]


def render() -> str:
    """The tables, one per section of `Settings`, in declaration order."""
    flags = cli_flags()
    lines: list[str] = []
    for name, field in Settings.model_fields.items():
        section = section_of(field)
        if section is not None or not lines:
            if lines:
                lines.append("")
            lines += [f"### {_title(section or 'settings')}", "",
                      "| setting | flag | environment variable | default | description |",
                      "| --- | --- | --- | --- | --- |"]
        if name not in flags:
            raise SystemExit(f"setting '{name}' has no command-line flag")
        flag = ", ".join(f"`{option}`" for option in flags[name])
        lines.append(f"| `{name}` | {flag} | `{ENV_PREFIX}{name.upper()}` | {_default(field)} | "
                     f"{_description(field)} |")
    return "\n".join(lines) + "\n"


def splice(text: str, table: str) -> str:
    """`text` with everything between the markers replaced by `table`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{DOC.relative_to(ROOT)}: the markers {BEGIN} ... {END} are missing")
    return f"{text[:start]}{BEGIN}\n\n{table}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The settings reference of docs/configuration.md.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the file in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file is out of date")
    args = parser.parse_args(argv)
    table = render()
    if not (args.write or args.check):
        sys.stdout.write(table)
        return 0
    current = DOC.read_text(encoding="utf-8")
    wanted = splice(current, table)
    if args.write:
        if wanted != current:
            DOC.write_text(wanted, encoding="utf-8")
        return 0
    if wanted != current:
        diff = difflib.unified_diff(current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                                    "docs/configuration.md", "generated")
        sys.stderr.write("".join(diff))
        sys.stderr.write(f"docs/configuration.md is out of date with the settings declared: run `{COMMAND}`\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
