"""Proxy mode: toolkv in front of OpenAI-compatible servers, routing by tool group (docs/operations/proxy.md)."""
