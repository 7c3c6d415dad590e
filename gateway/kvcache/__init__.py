"""The prefix KV cache: keys that make reuse provably correct, the block pool every key and value
lives in (preallocated, ref-counted blocks), the entries kept between requests and the RAM and
disk tiers that hold them, pins, and the store in front of the tiers. The engine holds one pool and
one store; nothing here imports the engine."""
