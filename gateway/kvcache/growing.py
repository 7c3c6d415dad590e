"""A KV cache layer that grows into preallocated room instead of concatenating on every token.

`DynamicLayer.update` copies the whole KV (`torch.cat`) at every decode step; with a 3,000-token
tool prefix that is ~140 MB of copying per generated token. This layer copies once into a buffer
sized for the whole generation and then writes each new token in place. The first update always
allocates a fresh buffer, so tensors restored from the prefix store are never written; unless
the stored prefix brings its own spare room (`adopt`), which the request then writes after the
prefix's last position.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped to mypy
    def __init__(self, room_tokens: int = 256) -> None:
        super().__init__()
        self.room_tokens = room_tokens
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        needed = used + key_states.shape[-2]
        if self._key_buf is None or needed > self._key_buf.shape[-2]:
            self._grow(needed + self.room_tokens, used, key_states, value_states)
        assert self._key_buf is not None and self._value_buf is not None
        self._key_buf[:, :, used:needed] = key_states
        self._value_buf[:, :, used:needed] = value_states
        self.keys = self._key_buf[:, :, :needed]
        self.values = self._value_buf[:, :, :needed]
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, key_room: torch.Tensor,
              value_room: torch.Tensor) -> None:
        """Start from a stored prefix whose buffers have room after it: new tokens are written
        into that room (never into the prefix's own positions), so nothing is copied."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._key_buf, self._value_buf = key_room, value_room

    def room(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The buffers `keys`/`values` are views of, with the room after them (None before use)."""
        return self._key_buf, self._value_buf

    def _grow(self, capacity: int, used: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._key_buf = _buffer_like(key_states, capacity, self.keys if used else None)
        self._value_buf = _buffer_like(value_states, capacity, self.values if used else None)


def _buffer_like(states: torch.Tensor, capacity: int, current: torch.Tensor | None) -> torch.Tensor:
    """[batch, heads, capacity, head_dim], holding `current` (if any) at the start."""
    buffer = states.new_empty((*states.shape[:2], capacity, states.shape[-1]))
    if current is not None:
        buffer[:, :, : current.shape[-2]] = current
    return buffer
