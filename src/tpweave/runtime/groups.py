"""Process-group setup from torchrun's environment (or from `launch`)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tpweave.runtime.context import TPContext


def default_collective_timeout_s() -> float:
    """Seconds a collective may wait before it raises instead of hanging (a dead or stuck peer):
    TPWEAVE_COLLECTIVE_TIMEOUT, read at call time, else 300."""
    text = os.environ.get("TPWEAVE_COLLECTIVE_TIMEOUT", "300")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"TPWEAVE_COLLECTIVE_TIMEOUT={text!r} is not a positive number of seconds")
    return value


# NVLink multicast can take a shared host's GPUs out of service: keep it off everywhere we start.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def pick_backend(num_procs: int) -> str:
    """ "nccl" when there is a CUDA GPU for each of `num_procs` processes, else "gloo"."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= num_procs:
        return "nccl"
    return "gloo"


def init_distributed(*, backend: str | None = None, timeout_s: float | None = None) -> TPContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(
            f"cannot join a process group: environment lacks {', '.join(missing)} (start with torchrun or "
            "tpweave.launch)"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    backend = backend or pick_backend(world_size)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        # Several ranks share the CPU: one thread each keeps gloo runs from oversubscribing it.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world_size, 1)))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s or default_collective_timeout_s())
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return TPContext.from_group(dist.group.WORLD, device=device)


def destroy_distributed() -> None:
    """Leave the default process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
