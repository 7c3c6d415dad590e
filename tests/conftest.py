"""Shared fixtures: the real SmolLM2 tokenizer, tiny random-weight models built from a config
(llama, qwen2, mistral), and JSON-schema validators for OpenAI's chat objects."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before Triton is imported: its kernels then run on CPU tensors, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No test speaks TLS (every server is http:// on 127.0.0.1), yet every httpx client (the SDKs',
# and each `httpx.get` of a readiness poll) builds an SSL context that reads the whole CA bundle
# named by SSL_CERT_FILE or certifi: ~30 ms of CPU each, thousands of times in a run. A hashed
# directory (SSL_CERT_DIR, which httpx honours when SSL_CERT_FILE is unset) is read lazily, per
# certificate, when a TLS peer asks: a context then costs well under a millisecond. Inherited by the
# servers and Ray workers the tests start.
if os.path.isdir("/etc/ssl/certs"):
    os.environ.pop("SSL_CERT_FILE", None)
    os.environ["SSL_CERT_DIR"] = "/etc/ssl/certs"

from gateway.bench.data import WORKLOADS as BENCH_WORKLOADS
from tests.support.models import DefaultModelCopy, build_tiny_model, save_tokenizer

WORKLOADS = BENCH_WORKLOADS  # the bench's workloads, shipped in the package (their README: provenance, licenses)
DATA = Path(__file__).resolve().parent / "data"  # the tests' own data (data/README.md)
SPEC = DATA / "openai-spec" / "openai_chat_schemas.lenient.json"
STRICT_SPEC = DATA / "openai-spec" / "openai_chat_schemas.strict.json"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[..., Path]:
    built: dict[tuple[str, int, int], Path] = {}

    def make(arch: str = "llama", seed: int = 0, context: int = 4096) -> Path:
        if (arch, seed, context) not in built:
            target = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}-{context}")
            built[(arch, seed, context)] = build_tiny_model(arch, target, tokenizer_dir, seed, context)
        return built[(arch, seed, context)]

    return make


@pytest.fixture(scope="session")
def default_model_copy(tmp_path_factory: pytest.TempPathFactory) -> DefaultModelCopy:
    return DefaultModelCopy(tmp_path_factory.mktemp("default-model-copy"))


@pytest.fixture(scope="session")
def merchant_tools() -> list[dict[str, Any]]:
    return json.loads((WORKLOADS / "merchant_100_tools.json").read_text())


@pytest.fixture(scope="session")
def openai_schema() -> Callable[[str, Any], None]:
    """validate(def_name, instance): raises if `instance` does not match OpenAI's schema."""
    from jsonschema import Draft202012Validator

    bundle = json.loads(SPEC.read_text())

    def validate(name: str, instance: Any) -> None:
        schema = {"$schema": bundle["$schema"], "$defs": bundle["$defs"], "$ref": f"#/$defs/{name}"}
        Draft202012Validator(schema).validate(instance)

    return validate


# Markers by where a test lives (pyproject.toml lists them): `pytest -m "not slow"` is the fast
# subset (pure functions: seconds): these folders, and a module elsewhere marked `model_free`;
# `-m "not browser and not ray"` skips what needs Chromium or Ray.
_FAST_DIRS = {"adapters", "settings", "test_import_rules.py"}
_BROWSER_FILES = {"test_dashboard_browser.py"}


# Folders that run first. Ray forks its head processes from this process: while it is small (forked
# late in a full run, after the fuzz and many models, fork failed with ENOMEM). And the longest
# groups first, so that .ci/run's two pytest-xdist workers end together (Ray's and the end-to-end
# file are each 5-8 minutes of the run; one picked up last would run alone at the end).
_FIRST = ("serve_ray", "e2e")


# Files that share a process-wide fixture, so one worker runs them: the kvcache files restart one
# first-run gateway (test_restart.py's `_first_run`).
_SHARED = {("kvcache", "test_restart.py"): "kvcache-first-run",
           ("kvcache", "test_hostile_cache_dir.py"): "kvcache-first-run"}


def _group(parts: tuple[str, ...]) -> str:
    """The test's pytest-xdist group: one per file (its module fixtures are set up once), all of
    tests/serve_ray in one (they share one Ray instance: its package fixtures), and `_SHARED`'s."""
    if parts[0] == "serve_ray":
        return "ray"
    return _SHARED.get(parts, "/".join(parts))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent

    def order(item: pytest.Item) -> int:
        folder = item.path.resolve().relative_to(root).parts[0]
        return _FIRST.index(folder) if folder in _FIRST else len(_FIRST)

    items.sort(key=order)
    for item in items:
        parts = item.path.resolve().relative_to(root).parts
        item.add_marker(pytest.mark.xdist_group(_group(parts)))
        if parts[0] not in _FAST_DIRS and item.get_closest_marker("model_free") is None:
            item.add_marker(pytest.mark.slow)
        if parts[0] == "serve_ray":
            item.add_marker(pytest.mark.ray)
        if item.path.name in _BROWSER_FILES:
            item.add_marker(pytest.mark.browser)
