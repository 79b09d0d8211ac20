"""Symmetric-memory staging buffers, one per (group, dtype, device), grown before CUDA graph capture.

Like NCCL communicators these are process-wide resources: a buffer must exist (rendezvoused on
every rank) before a graph that uses it is captured, since capture cannot allocate or rendezvous.
`reserve` sizes them for the largest M up front; growing during capture raises a clear error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class SymmBuffer:
    """A symmetric buffer, its rendezvous handle (peer buffer pointers, signal pads, barrier), and the
    state of the protocol that uses it (kept with the buffer: a new buffer starts fresh)."""

    tensor: torch.Tensor
    handle: Any
    state: dict[str, Any] = field(default_factory=dict)


# Process-wide, like NCCL communicators: (group, dtype, device, tag) -> its buffer.
_BUFFERS: dict[tuple[str, torch.dtype, torch.device, str], SymmBuffer] = {}
# Outgrown buffers stay alive: a CUDA graph captured earlier still reads and writes them.
_RETIRED: list[SymmBuffer] = []


def reserve(
    group_name: str, numel: int, dtype: torch.dtype, device: torch.device, *, tag: str = "staging"
) -> SymmBuffer:
    """The buffer for (group, dtype, device, tag), at least `numel` elements. Kernels that keep their
    own signalling in the signal pads take their own tag, so no two protocols share a pad."""
    import torch.distributed._symmetric_memory as symm_mem

    key = (group_name, dtype, torch.device(device), tag)
    buf = _BUFFERS.get(key)
    if buf is None or buf.tensor.numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            have = 0 if buf is None else buf.tensor.numel()
            raise RuntimeError(
                f"symmetric buffer for group {group_name} holds {have} elements, {numel} needed during CUDA graph "
                "capture: run the largest M once (or call tpweave.ops.symm_buffers.reserve) before capturing"
            )
        if buf is not None:
            _RETIRED.append(buf)
        tensor = symm_mem.empty(numel, dtype=dtype, device=device)
        buf = _BUFFERS[key] = SymmBuffer(tensor, symm_mem.rendezvous(tensor, group_name))
    return buf


def staged(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """x copied into the symmetric buffer (a view of its first x.numel() elements, shaped like x)."""
    buf = reserve(group_name, x.numel(), x.dtype, x.device)
    view = buf.tensor[: x.numel()].view(x.shape)
    view.copy_(x)
    return view


@functools.cache
def wait_timeout_ms(group_name: str) -> int:
    """How long a kernel waits for a peer's signal before it stops the process with a message: the
    group's collective timeout, the bound on legitimate skew that NCCL collectives have too (a rank
    that died inside a symmetric-memory op must not leave its peers' GPUs spinning forever)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from tpweave.runtime.groups import default_collective_timeout_s

    group = _resolve_process_group(group_name)
    for device_type in ("cuda", "cpu"):
        try:
            return max(1, int(group._get_backend(torch.device(device_type)).options._timeout.total_seconds() * 1000))
        except (AttributeError, RuntimeError):  # no backend for this device type, or no options on it
            continue
    return int(default_collective_timeout_s() * 1000)


@functools.cache
def has_symm_mem_ops(*names: str) -> bool:
    """Whether torch.ops.symm_mem has all of `names` (importing the module that registers them)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(torch.ops.symm_mem, n) for n in names)
