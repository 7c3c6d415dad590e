"""Pick the chat family for a model: from settings, else from its chat template and config."""

from __future__ import annotations

from adapters.base import ChatFamily
from adapters.hermes import HermesFamily
from adapters.llama3 import Llama3Family
from adapters.mistral import MistralFamily

ADAPTER_VERSION = "2"  # bump when any rendering changes: it is part of every cache key

_FAMILIES: dict[str, type[ChatFamily]] = {
    family.name: family for family in (HermesFamily, Llama3Family, MistralFamily)
}

# Markers each family's templates write, checked in this order: a ChatML template wins over the
# model type (OpenHermes-Mistral is `mistral` but speaks ChatML).
_TEMPLATE_MARKERS = (
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama3"),
    ("[AVAILABLE_TOOLS]", "mistral"),
    ("[INST]", "mistral"),
)
_MODEL_TYPES = {"mistral": "mistral", "mixtral": "mistral"}


def family_names() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def register(family: type[ChatFamily]) -> None:
    _FAMILIES[family.name] = family


def get_family(name: str) -> ChatFamily:
    try:
        return _FAMILIES[name]()
    except KeyError:
        raise ValueError(f"unknown adapter {name!r}; valid choices: {', '.join(family_names())}") from None


def detect_family(model_type: str, chat_template: object) -> ChatFamily:
    """The family whose markers the chat template writes; else by model type; else ChatML."""
    template = _template_text(chat_template)
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            return get_family(name)
    return get_family(_MODEL_TYPES.get(model_type, "chatml"))


def _template_text(chat_template: object) -> str:
    if isinstance(chat_template, dict):  # several named templates
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template if isinstance(chat_template, str) else ""
