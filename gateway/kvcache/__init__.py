"""The prefix KV cache: keys that make reuse provably correct, and the tiers that hold entries."""
