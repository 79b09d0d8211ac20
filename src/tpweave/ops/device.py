"""Facts of a CUDA device that launch plans are sized by, read once per device."""

from __future__ import annotations

import functools

import torch


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (the current device where `device` names no index)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
