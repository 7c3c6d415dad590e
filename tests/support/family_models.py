"""Models for the tool-calling tests.

* Family tokenizers: the SmolLM2 vocabulary plus a family's special tokens and a chat template
  written in the shape of that family's real one (templates/), so detection, rendering and the
  prefix cut run on each family's format.
* Tiny random-weight models for them, with a context long enough for tau-bench histories.
* A scripted model: a tiny model whose logits are replaced so that it writes the text between
  the last ⟦ and ⟧ of its prompt (in a user message, or a tool result for the next step of an
  agent loop), then ends. Its KV cache stays real (the engine, the
  prefix cache and the detokenizer all run as usual); it lets HTTP and client tests see what a
  trained model writes — several calls, text and calls, a broken call — deterministically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from gateway.engine.model_loader import load_model
from gateway.metrics import Metrics
from gateway.serving.runtime import Runtime, build_runtime
from gateway.settings import Settings
from tests.support.models import build_tiny_model

TEMPLATES = Path(__file__).resolve().parent / "templates"
CONTEXT_LEN = 16384  # tau-bench airline histories run to ~6k tokens
SCRIPT_OPEN, SCRIPT_CLOSE = "⟦", "⟧"


@dataclass(frozen=True)
class FamilySetup:
    family: str  # the adapter detection should pick
    arch: str
    template: str | None  # file in templates/; None keeps SmolLM2's (which drops tools)
    special_tokens: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None


SETUPS = {
    "chatml": FamilySetup("chatml", "llama", None),
    "chatml-native": FamilySetup("chatml", "qwen2", "qwen2_5_style.jinja"),
    "llama3": FamilySetup("llama3", "llama", "llama3_1_style.jinja",
                          ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                           "<|eom_id|>", "<|python_tag|>"), bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "mistral": FamilySetup("mistral", "mistral", "mistral_v3_style.jinja",
                           ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), bos="<s>", eos="</s>"),
}


def save_family_tokenizer(setup: FamilySetup, base_dir: Path, target: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if setup.special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(setup.special_tokens)})
    if setup.bos:
        tokenizer.bos_token = setup.bos
    if setup.eos:
        tokenizer.eos_token = setup.eos
    if setup.template:
        tokenizer.chat_template = (TEMPLATES / setup.template).read_text()
    tokenizer.save_pretrained(target)
    return target


def build_family_model(setup: FamilySetup, base_tokenizer_dir: Path, target: Path, seed: int = 0) -> Path:
    tokenizer_dir = save_family_tokenizer(setup, base_tokenizer_dir, target / "tokenizer")
    model_dir = build_tiny_model(setup.arch, target / "model", tokenizer_dir, seed)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = CONTEXT_LEN  # rotary positions: no weights depend on it
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def script_model(model: Any, tokenizer: Any) -> None:
    """Make `model` write the last ⟦script⟧ of its prompt (see the module docstring). It writes
    text, not a fixed list of tokens: each next token is the first of the rest of the script after
    what it wrote so far, so tokens the engine feeds in a chunk of their own (a grammar's forced
    tokens, spelled its own way) keep it on the script."""
    inner = model.forward
    state: dict[str, Any] = {"script": None, "prompt": [], "written": [], "end": -1, "last": None}

    def forward(*args: Any, input_ids: Any, **kwargs: Any) -> Any:
        out = inner(*args, input_ids=input_ids, **kwargs)
        positions = kwargs.get("position_ids")
        start = int(positions[0, 0]) if positions is not None else 0
        ids = input_ids[0].tolist()
        if (start == state["end"] and state["last"] is not None and ids[0] == state["last"]
                and state["script"].startswith(tokenizer.decode(state["written"] + ids))):
            state["written"] += ids  # the token it wrote, and any forced after it (a prompt chunk
            # may start with the very token it would write: an earlier turn's answer, cut after its opening)
        else:  # a prompt chunk (the engine prefills in chunks: the text so far is the chunks since
            # position 0, or since a hit's cut)
            state["prompt"] = (state["prompt"] if start == state["end"] else []) + ids
            state["script"], state["written"] = _script_text(tokenizer, state["prompt"]), []
        state["end"] = start + len(ids)
        state["last"] = None
        if state["script"] is not None:
            token = _next_token(tokenizer, state["script"], state["written"])
            out.logits[:, -1, :] = float("-inf")
            out.logits[:, -1, token] = 0.0
            state["last"] = token
        return out

    model.forward = forward


def _next_token(tokenizer: Any, script: str, written: list[int]) -> int:
    whole = tokenizer(script, add_special_tokens=False)["input_ids"]
    if written == whole[:len(written)]:  # on the script's own tokens
        return int(whole[len(written)]) if len(written) < len(whole) else int(tokenizer.eos_token_id)
    done = tokenizer.decode(written)
    rest = script[len(done):] if script.startswith(done) else ""
    ids = tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    return int(ids[0]) if ids else int(tokenizer.eos_token_id)


def _script_text(tokenizer: Any, prompt_ids: list[int]) -> str | None:
    text = tokenizer.decode(prompt_ids)
    start = text.rfind(SCRIPT_OPEN)
    end = text.find(SCRIPT_CLOSE, start)
    if start < 0 or end < 0:
        return None
    return str(text[start + 1:end])


def scripted_runtime(settings: Settings, metrics: Metrics) -> Runtime:
    """A runtime factory for `create_app`: the configured model, scripted. Conversation reuse is
    off: the script is read from the prompt chunks a request computes, and a reused turn would
    not compute the message that holds it. The model runs on transformers' eager fallback
    (`fused_layers` off): toolkv's own model reads the checkpoint's weights and never calls the
    scripted `forward`."""
    loaded = load_model(settings)
    script_model(loaded.model, loaded.tokenizer)
    scripted = settings.model_copy(update={"conversation_reuse": "off", "fused_layers": False})
    return build_runtime(scripted, metrics, loaded)


def script(text: str) -> str:
    """A message (user text, or tool result) that makes the scripted model reply `text`."""
    return f"Please reply exactly: {SCRIPT_OPEN}{text}{SCRIPT_CLOSE}"


def family_settings(model_dir: Path, name: str, cache_dir: Path) -> Settings:
    from gateway.settings import load_settings

    return load_settings(overrides={"model": str(model_dir), "served_model_name": f"tiny-{name}",
                                    "min_prefix_tokens": 8, "cache_dir": str(cache_dir),
                                    "disk_budget_bytes": 0, "default_max_tokens": 16}, environ={})
