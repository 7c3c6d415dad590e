"""toolkv: an OpenAI-compatible gateway that caches the KV state of tool-group prefixes."""

__version__ = "0.1.0"
