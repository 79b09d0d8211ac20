"""Start-up check that every rank runs the same model and options."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist


def _canonical(values: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): json.dumps(v, sort_keys=True, default=str) for k, v in values.items()}


def check_ranks_agree(values: Mapping[str, Any], *, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise ValueError naming the first differing key if the ranks of `group` disagree on `values`."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = _canonical(values)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (digest, mine), group=group)
    if len({d for d, _ in gathered}) == 1:
        return
    ref = gathered[0][1]
    diffs = []
    for rank, (_, other) in enumerate(gathered):
        for key in sorted(set(ref) | set(other)):
            if ref.get(key) != other.get(key):
                diffs.append(
                    f"{key!r}: rank 0 has {ref.get(key, '<missing>')}, rank {rank} has {other.get(key, '<missing>')}"
                )
    raise ValueError(f"ranks disagree on {what}: " + "; ".join(diffs[:8]))
