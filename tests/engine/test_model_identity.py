"""The model fingerprint (part of every cache key) follows what decides the KV's numbers."""

from __future__ import annotations

from gateway.engine.model_loader import FORCE_GQA_ENV, load_model
from gateway.settings import load_settings


def test_the_attention_kernel_path_is_part_of_the_fingerprint(tiny_model_dir, monkeypatch):
    settings = load_settings(overrides={"model": str(tiny_model_dir("llama")), "device": "cpu"}, environ={})
    monkeypatch.delenv(FORCE_GQA_ENV, raising=False)
    native = load_model(settings)  # on CPU: grouped-query attention in SDPA itself
    assert native.device.type == "cpu"
    assert load_model(settings).fingerprint == native.fingerprint  # stable across loads
    monkeypatch.setenv(FORCE_GQA_ENV, "0")  # an explicit setting is kept, and keys other entries
    assert load_model(settings).fingerprint != native.fingerprint
