"""Pick the chat family for a model: from settings, else from its chat template and config."""

from __future__ import annotations

from adapters.base import ChatFamily
from adapters.hermes import HermesFamily

ADAPTER_VERSION = "1"  # bump when any rendering changes: it is part of every cache key

_FAMILIES: dict[str, type[ChatFamily]] = {HermesFamily.name: HermesFamily}


def family_names() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def register(family: type[ChatFamily]) -> None:
    _FAMILIES[family.name] = family


def get_family(name: str) -> ChatFamily:
    try:
        return _FAMILIES[name]()
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; valid choices: {', '.join(family_names())}") from None


def detect_family(model_type: str, chat_template: str | None) -> ChatFamily:
    template = chat_template or ""
    if "<|start_header_id|>" in template and "llama3" in _FAMILIES:
        return get_family("llama3")
    if ("[INST]" in template or model_type == "mistral") and "mistral" in _FAMILIES:
        return get_family("mistral")
    return get_family("chatml")
