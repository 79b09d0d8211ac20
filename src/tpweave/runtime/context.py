"""The tensor-parallel context every TP layer and pass receives explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    """Which TP group a model runs on. `group_name` is what functional collectives take."""

    rank: int
    world_size: int
    group_name: str | None
    device: torch.device

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> TPContext:
        """Rank 0 of 1 on `device`, without a group: no communication."""
        return cls(rank=0, world_size=1, group_name=None, device=torch.device(device))

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None) -> TPContext:
        """This process's rank and size in `group` (default: the world group), on `device` (default:
        default_device of its rank); ValueError when torch.distributed is not initialized."""
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialized: call tpweave.init_distributed() or use tpweave.launch()"
            )
        group = group if group is not None else dist.group.WORLD
        if device is None:
            device = default_device(dist.get_rank(group))
        return cls(
            rank=dist.get_rank(group), world_size=dist.get_world_size(group), group_name=group.group_name, device=device
        )

    @property
    def comm_group_name(self) -> str | None:
        """The group a TP layer's collectives run on: group_name, or None for a single rank (nothing to sum or
        gather: a one-rank collective is a copy, and in a CUDA graph a node that PDL chains cannot cross)."""
        return self.group_name if self.world_size > 1 else None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group named group_name, None without one."""
        if self.group_name is None:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(self.group_name)


def default_device(local_rank: int) -> torch.device:
    """cuda:(local_rank mod the GPU count) when CUDA is available and the backend is not gloo, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else None
    if torch.cuda.is_available() and backend != "gloo":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
