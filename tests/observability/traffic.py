"""Requests the observability tests send through the OpenAI SDK, on one small tool group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import LiveServer

BYPASS = {"X-Toolkv-Cache": "bypass"}

WEATHER_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


@dataclass
class Exercised:
    """A gateway and what its clients were told, to compare with what /metrics says."""

    server: LiveServer
    usages: list[Any] = field(default_factory=list)
    streams: int = 0
    non_streams: int = 0


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, text: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(**_request(client, text), **kwargs)


def chat_streamed(client: openai.OpenAI, text: str) -> Any:
    """The usage chunk of a streamed completion."""
    stream = client.chat.completions.create(**_request(client, text), stream=True,
                                            stream_options={"include_usage": True})
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1
    return usages[0]


def _request(client: openai.OpenAI, text: str) -> dict[str, Any]:
    return {"model": model_id(client), "messages": [{"role": "user", "content": text}],
            "tools": WEATHER_TOOLS, "max_tokens": 4, "temperature": 0}


def scrape(server: LiveServer) -> tuple[str, dict[str, Metric]]:
    """The /metrics text and its families by name (the parser strips `_total` from counters)."""
    resp = httpx.get(server.base_url + "/metrics", timeout=30)
    resp.raise_for_status()
    return resp.text, {family.name: family for family in text_string_to_metric_families(resp.text)}
