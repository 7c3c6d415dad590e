"""A GGUF model's converted weights are kept (gateway/engine/gguf_copy.py): the second load reads
the copy, gives the same model (fingerprint, weights, logits) and the same tokenizer, and a copy
that is corrupt or stale is converted again, never a failed start."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gateway.engine.gguf_copy import MANIFEST_FILE, WEIGHTS_FILE, copies_dir
from gateway.engine.model_loader import LoadedModel, load_model
from gateway.settings import Settings, load_settings


@dataclass(frozen=True)
class Converted:
    cache_dir: Path  # holds the copy the conversion wrote; copied, never changed, by the tests
    fingerprint: str
    tokenizer_fingerprint: str
    chat_template: str
    logits: torch.Tensor


def settings_for(gguf: Path, cache_dir: Path) -> Settings:
    return load_settings(overrides={"model": str(gguf), "device": "cpu", "cache_dir": str(cache_dir)}, environ={})


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    cache_dir = tmp_path_factory.mktemp("converted")
    loaded = load_model(settings_for(tiny_gguf, cache_dir))
    return Converted(cache_dir, loaded.fingerprint, loaded.tokenizer_fingerprint, loaded.tokenizer.chat_template,
                     logits(loaded))


@pytest.fixture
def load(tiny_gguf: Path, converted: Converted, tmp_path: Path) -> Callable[[], LoadedModel]:
    """A start with the conversion's copy in its cache dir."""
    shutil.copytree(copies_dir(converted.cache_dir), copies_dir(tmp_path))
    return lambda: load_model(settings_for(tiny_gguf, tmp_path))


def only_copy(cache_dir: Path) -> Path:
    [copy] = [p for p in copies_dir(cache_dir).iterdir() if p.is_dir()]
    return copy


def logits(loaded: LoadedModel) -> torch.Tensor:
    ids = loaded.tokenizer("What was our GMV last week?", return_tensors="pt").input_ids
    with torch.no_grad():
        return loaded.model(ids).logits  # type: ignore[no-any-return]


def converting(caplog: pytest.LogCaptureFixture) -> bool:
    return any("converting" in r.getMessage() for r in caplog.records)


def test_a_start_after_the_first_reads_the_copy_and_gets_the_same_model(load, converted, caplog):
    with caplog.at_level("INFO", logger="gateway.engine"):
        kept = load()
    assert not converting(caplog)  # the GGUF was not converted again
    assert kept.fingerprint == converted.fingerprint  # cache keys stay valid from the first start on
    assert kept.tokenizer_fingerprint == converted.tokenizer_fingerprint
    assert kept.tokenizer.chat_template == converted.chat_template
    assert torch.equal(logits(kept), converted.logits)


@pytest.mark.parametrize("damage", ["flip a weight byte", "truncate the weights", "drop the config",
                                    "name another source"])
def test_a_damaged_copy_is_converted_again(load, converted, tmp_path, damage, caplog):
    copy = only_copy(tmp_path)
    weights, manifest = copy / WEIGHTS_FILE, copy / MANIFEST_FILE
    if damage == "flip a weight byte":
        data = bytearray(weights.read_bytes())
        data[-7] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate the weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "drop the config":
        (copy / "config.json").unlink()
    else:
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "gguf_digest": "0" * 64}))
    with caplog.at_level("INFO", logger="gateway.engine"):
        again = load()
    assert converting(caplog)
    assert torch.equal(logits(again), converted.logits)
    caplog.clear()
    with caplog.at_level("INFO", logger="gateway.engine"):
        assert load().fingerprint == converted.fingerprint  # the rebuilt copy serves the next start
    assert not converting(caplog)
    assert only_copy(tmp_path).name == copy.name


def test_a_cache_dir_that_cannot_be_written_still_loads(tiny_gguf, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert load_model(settings_for(tiny_gguf, blocked)).model is not None


def test_no_temp_directory_is_left_behind(converted):
    assert [p.name for p in copies_dir(converted.cache_dir).iterdir()] == [only_copy(converted.cache_dir).name]
