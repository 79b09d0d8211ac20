"""Running a command's work on every TP rank: ranks spawned here (`launch`), or this process being one
rank of a torchrun / SLURM job (`--launcher torchrun`, or detected from the environment)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpweave.cli.errors import CLIError
from tpweave.log import enable_progress

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankOptions:
    """How the ranks run: launcher ("auto", "spawn", "torchrun"), their number, a timeout for the whole
    run (seconds), and whether rank 0 prints progress."""

    launcher: str
    tp: int
    timeout_s: float
    progress: bool = True


def launcher_in_use(choice: str) -> str:
    """ "torchrun" when asked, or ("auto") when torchrun's environment is set; else "spawn"."""
    if choice != "auto":
        return choice
    return "torchrun" if all(v in os.environ for v in TORCHRUN_VARS) else "spawn"


def check_launcher(opts: RankOptions) -> None:
    """Refuse a torchrun launch whose world size differs from --tensor-parallel-size (before any rank works)."""
    if launcher_in_use(opts.launcher) != "torchrun":
        return
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise CLIError(f"--launcher torchrun: the environment lacks {', '.join(missing)} (start under torchrun)")
    world = int(os.environ["WORLD_SIZE"])
    if opts.tp != world:
        raise CLIError(f"--tensor-parallel-size {opts.tp} differs from torchrun's WORLD_SIZE={world}")


def _rank_main(ctx, fn: Callable[..., Any], args: tuple, progress: bool) -> Any:
    if progress and ctx.rank == 0:
        enable_progress()
    return fn(ctx, *args)


def run_ranks(fn: Callable[..., Any], *args: Any, opts: RankOptions) -> list[Any]:
    """fn(ctx, *args) on every rank; every rank's return value, in rank order. Under torchrun this process
    is one rank: the values are gathered from all, and only rank 0 keeps printing to stdout."""
    check_launcher(opts)
    if launcher_in_use(opts.launcher) == "spawn":
        from tpweave.runtime import launch

        return launch(_rank_main, fn, args, opts.progress, nprocs=opts.tp, timeout_s=opts.timeout_s)
    import torch.distributed as dist

    from tpweave.runtime import init_distributed

    ctx = init_distributed()
    if ctx.rank != 0:
        sys.stdout = open(os.devnull, "w")  # one writer: rank 0
    out = _rank_main(ctx, fn, args, opts.progress)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, out)
    with contextlib.suppress(Exception):
        dist.barrier()
    return gathered
