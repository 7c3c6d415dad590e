"""Tool calls streamed out of model output as it is generated, for every family's call syntax
(`incremental.SyntaxStreamer`), and vLLM's `--tool-call-parser` names mapped onto the families
(`vllm_names`). The whole-text parsers are the tests' oracle (tests/support/toolcalls/).
"""

from __future__ import annotations

from adapters.toolcalls.incremental import (
    ContentDelta,
    StreamDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    ToolCallStreamer,
)

__all__ = ["ContentDelta", "StreamDelta", "ToolCallArgsDelta", "ToolCallStart", "ToolCallStreamer"]
