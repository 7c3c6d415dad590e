"""Chat formats and tool-call syntax per model family. Knows nothing about HTTP or caching."""
