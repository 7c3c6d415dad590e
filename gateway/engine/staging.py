"""Small host values on their way to the device without a wait: on CUDA a copy from pageable
memory waits for every step queued on the stream (it is staged through a driver buffer after a
sync), so a step built while another is in flight, or a sampler's per-row values, would stall the
host until the device is idle. Pinned memory and a non-blocking copy do not; PyTorch's pinned
allocator keeps the host block until its copy has run."""

from __future__ import annotations

from typing import Any

import torch


def staged(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or equal-length lists) as a tensor on `device`; on CUDA through pinned
    memory, without waiting for the device."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
