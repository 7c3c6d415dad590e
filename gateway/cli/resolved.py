"""What `toolkv config` shows for a setting decided at start-up (`auto`, or left unset for a default
that depends on the machine): the value `serve` would use here, worked out by the functions `serve`
calls, without loading the model. Also the checks of vLLM's flags that `serve` runs before it
loads anything (an unknown `--tool-call-parser`, an unreadable `--chat-template`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.toolcalls.vllm_names import VLLM_TOOL_PARSERS, adapter_for
from gateway.cli_errors import CliError
from gateway.errors import ModelLoadFailed
from gateway.settings import Settings, SettingsError, describe_chat_template, read_chat_template

if TYPE_CHECKING:
    from gateway.engine.plan import EnginePlan


def check_vllm_flags(settings: Settings) -> None:
    """CliError for a `tool_call_parser` toolkv does not read, or a `chat_template` that cannot be
    read or parsed: start-up stops before the model loads."""
    try:
        adapter_for(settings.adapter, settings.tool_call_parser)
        if settings.chat_template:
            read_chat_template(settings.chat_template)
    except (SettingsError, ValueError) as exc:
        raise CliError(str(exc)) from None


def resolved_values(settings: Settings) -> dict[str, str]:
    """Setting name -> the value this machine will use and why, for the settings whose value is
    decided at start-up. Proxy mode loads no model: only vLLM's flags are shown."""
    shown = _vllm_flags(settings)
    if settings.upstreams:
        return shown
    from gateway.engine.cpu_threads import usable_cpus  # lazy: torch
    from gateway.engine.model_loader import ModelLoadError, pick_device, pick_dtype, resolve_source  # lazy: torch
    from gateway.engine.plan import engine_plan  # lazy: the engine (torch)
    from gateway.serving.kv_pool_size import describe_default, pool_share  # lazy: torch

    device = pick_device(settings.device)
    on = f"default on {device.type}"
    if settings.device == "auto":
        shown["device"] = f"{device.type} (auto)"
    if settings.dtype == "auto":
        shown["dtype"] = f"{str(pick_dtype('auto', device)).removeprefix('torch.')} (auto on {device.type})"
    try:
        plan = engine_plan(settings, device)
    except ModelLoadFailed as exc:
        shown["attention_backend"] = f"{settings.attention_backend}: {exc}"
    else:
        shown.update(_planned(settings, plan, on))
    if settings.num_threads is None:
        fewer = "; fewer while others hold them" if settings.adaptive_threads else ""
        shown["num_threads"] = f"{usable_cpus()} (the cores this process may use{fewer})"
    if settings.ram_budget_bytes is None:
        shown["ram_budget_bytes"] = describe_default(settings, device)
    if settings.gpu_memory_utilization is None:
        shown["gpu_memory_utilization"] = f"{pool_share(settings, device):g} ({on})"
    if settings.served_model_name is None:
        try:
            shown["served_model_name"] = f"{resolve_source(settings).served_name} (from the model)"
        except ModelLoadError:
            pass  # `serve` says why; `config` shows the settings
    return shown


def _vllm_flags(settings: Settings) -> dict[str, str]:
    shown: dict[str, str] = {}
    parser = VLLM_TOOL_PARSERS.get(settings.tool_call_parser or "")
    if parser is not None:
        shown["tool_call_parser"] = f"{settings.tool_call_parser} (toolkv's {parser.parser} parser)"
        shown["adapter"] = f"{adapter_for(settings.adapter, settings.tool_call_parser)} (from tool_call_parser)"
    if settings.chat_template:
        shown["chat_template"] = describe_chat_template(settings.chat_template)
    return shown


def _planned(settings: Settings, plan: EnginePlan, on: str) -> dict[str, str]:
    shown: dict[str, str] = {}
    if settings.attention_backend == "auto":
        shown["attention_backend"] = f"{plan.backend} (auto)"
    if settings.max_batch is None:
        shown["max_batch"] = f"{plan.max_batch} ({on})"
    if settings.prefill_chunk_tokens is None:
        shown["prefill_chunk_tokens"] = f"{plan.chunk_tokens} ({on})"
    if settings.batch_invariant is None:
        shown["batch_invariant"] = f"{str(plan.batch_invariant).lower()} ({on})"
    if settings.decode_overlap is None:
        shown["decode_overlap"] = f"{str(plan.overlap).lower()} ({on})"
    return shown
