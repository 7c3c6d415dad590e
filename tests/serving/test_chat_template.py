"""vLLM's `--chat-template`: the template given renders every prompt instead of the model's own, and
is part of the cache key, so KV computed under one template never serves a prompt of another."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.base import ChatMessage, ToolSpec
from gateway.kvcache.entry import PrefixKey
from gateway.metrics import Metrics
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import load_settings

HOUSE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} (house template)\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Paris?")]
TOOLS = [ToolSpec("get_weather", "Get the weather", {"type": "object", "properties": {"city": {"type": "string"}}})]


@pytest.fixture
def runtime_for(tiny_model_dir: Callable[..., Path]) -> Iterator[Callable[..., Runtime]]:
    made: list[Runtime] = []

    def make(**overrides: Any) -> Runtime:
        settings = load_settings(overrides={"model": str(tiny_model_dir()), "disk_budget_bytes": 0, **overrides},
                                 environ={})
        made.append(build_runtime(settings, Metrics()))
        return made[-1]

    yield make
    for runtime in made:
        runtime.engine.stop()


def test_a_chat_template_renders_the_prompt_and_keys_the_cache(runtime_for: Callable[..., Runtime],
                                                                tmp_path: Path) -> None:
    template = tmp_path / "house.jinja"
    template.write_text(HOUSE_TEMPLATE)
    own, house = runtime_for(), runtime_for(chat_template=str(template))
    own_prompt = own.service.renderer.render(MESSAGES, TOOLS)
    house_prompt = house.service.renderer.render(MESSAGES, TOOLS)
    assert "(house template)" in house_prompt.text and "(house template)" not in own_prompt.text
    assert "get_weather" in house_prompt.text[:house_prompt.prefix_chars]  # its tool group is still cached
    own_identity, house_identity = own.service.info.identity, house.service.info.identity
    assert own_identity is not None and house_identity is not None
    same_tokens = [1, 2, 3, 4]
    assert PrefixKey.of(own_identity, same_tokens).digest != PrefixKey.of(house_identity, same_tokens).digest
    inline = runtime_for(chat_template=HOUSE_TEMPLATE)  # the template itself, as vLLM takes it too
    assert inline.service.renderer.render(MESSAGES, TOOLS).text == house_prompt.text
    assert inline.service.info.identity == house_identity  # the same template: the same key
