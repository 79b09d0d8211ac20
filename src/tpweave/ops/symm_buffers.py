"""Symmetric-memory staging buffers, one per (group, dtype, device), grown before CUDA graph capture,
and the other state the strategies keep from call to call.

Like NCCL communicators these are process-wide resources: a buffer must exist (rendezvoused on
every rank) before a graph that uses it is captured, since capture cannot allocate or rendezvous.
`reserve` sizes them for the largest M up front; growing during capture raises a clear error. A
buffer that grows is retired, not freed: graphs captured with it keep replaying it.

Every such piece of state lives outside every CUDA graph's memory pool, so that any graph mode can hold
the strategies: symmetric memory comes from its own allocator, and ordinary tensors kept across calls
(call counters) are allocated by `outside_graph_pools`. Inductor's CUDA graph trees route every
allocation of the thread that warms up or records a graph into that graph's pool; a tensor kept there
past the call would be overwritten by a later replay (trees refuse it: "not tracked").
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


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


def outside_graph_pools(make: Callable[[], T], device: torch.device) -> T:
    """make() run on a helper thread, whose allocations no CUDA graph pool takes (pools route by capturing
    stream or by thread), its kernels finished before this returns. Not during a capture: the memory a
    graph replays must exist before it is captured."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "tpweave: persistent state allocated during CUDA graph capture: run the step once before capturing it"
        )
    out: list = []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                out.append(make())
                torch.cuda.current_stream().synchronize()  # initialized before another stream reads it
        except BaseException as e:  # re-raised on the caller's thread
            out.append(e)

    worker = threading.Thread(target=run, name="tpweave-alloc")
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# Every workspace torch's symm_mem fused ops allocated, process-wide: torch frees the old one when a larger call
# regrows it, while CUDA graphs captured with the old one still replay it.
_TORCH_WORKSPACES: list[torch.Tensor] = []


def retain_torch_workspace(group_name: str) -> None:
    """Keep the workspace torch's fused ops now use for `group_name` alive for the life of the process."""
    import torch.distributed._symmetric_memory as symm_mem

    tensor = getattr(symm_mem, "_group_name_to_workspace_tensor", {}).get(group_name)
    if tensor is not None and not any(t is tensor for t in _TORCH_WORKSPACES):
        _TORCH_WORKSPACES.append(tensor)


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
