"""The TP process group as the graph passes see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """The group whose all-reduces the passes rewrite: its name (what the graph's collectives carry),
    this rank in it, its size and its backend ("nccl", "gloo")."""

    group_name: str
    rank: int
    world_size: int
    backend: str = "gloo"

    @classmethod
    def of(cls, group: dist.ProcessGroup | str | None) -> TPGroup:
        """The TPGroup of a process group, a group name, or (None) the default group; without any process
        group (one process, TP=1) a group of one rank."""
        if not dist.is_initialized():
            if group is None:
                return cls("", 0, 1, "none")
            raise ValueError(
                f"group {group!r} given, but no process group is initialized (tpweave.launch or init_distributed)"
            )
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        group = group or dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup, a group name or None, got {type(group).__name__}")
        return cls(group.group_name, dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)))

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group of this name."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(self.group_name)
