"""Settings: one declaration (`Settings`, each field with its description) that the TOML file, the
`TOOLKV_*` environment variables and the command line (`toolkv serve --help` is built from it) all
fill, through pydantic-settings' sources.

Precedence (highest first): the command line, `TOOLKV_*` environment variables, the TOML file, the
defaults in declaration.py (as vLLM and pydantic-settings order them). A bad value, or an unknown key in the
file, stops start-up with a message naming the key (and the file); an unknown `TOOLKV_*` variable
is a warning naming it (and the closest setting), since the environment holds what other tools left.
Byte budgets take sizes: `8GiB`, `512MB`, `1.5 GiB` or plain bytes.

The package: `declaration.py` (the `Settings` class), `loading.py` (the sources merged, with where
each value came from), `parts.py` (sizes, field markers, shared checks, error wording), `chat_template.py` (the
`chat_template` setting read into template text).
"""

from gateway.settings.chat_template import describe_chat_template, read_chat_template
from gateway.settings.declaration import DEFAULT_CONFIG, DEFAULT_MODEL, Settings
from gateway.settings.loading import (
    LIST_SETTINGS,
    ResolvedSettings,
    config_or_default,
    load_settings,
    resolve_settings,
)
from gateway.settings.parts import (
    ENV_PREFIX,
    SECRET_SETTINGS,
    Bytes,
    Cli,
    SettingsError,
    Source,
    cli_of,
    format_size,
    is_size,
    parse_size,
    section,
    section_of,
    shown_value,
    split_list,
    upstream_base_url,
)

__all__ = ["DEFAULT_CONFIG", "DEFAULT_MODEL", "ENV_PREFIX", "LIST_SETTINGS", "SECRET_SETTINGS", "Bytes", "Cli",
           "ResolvedSettings", "Settings", "SettingsError", "Source", "cli_of", "config_or_default",
           "describe_chat_template", "format_size", "is_size", "load_settings", "parse_size", "read_chat_template",
           "resolve_settings", "section", "section_of", "shown_value", "split_list", "upstream_base_url"]
