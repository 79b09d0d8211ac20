"""Checks every command makes before any rank starts, and what several commands share."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from tpweave.cli.errors import CLIError
from tpweave.cli.ranks import RankOptions, check_launcher
from tpweave.models.config import DTYPES, ModelConfig


def model_config(args: argparse.Namespace, **overrides) -> ModelConfig:
    """The --model's config (with overrides), checked against --tensor-parallel-size; a model directory's checkpoint
    checked to hold every tensor the model needs in its shape; CLIError naming the flag."""
    from tpweave.models import resolve_config
    from tpweave.models.weights import check_checkpoint

    try:
        cfg = resolve_config(args.model, **overrides)
    except (ValueError, TypeError) as e:
        raise CLIError(f"--model {args.model}: {e}") from None
    try:
        cfg.check_tp(args.tp)
    except ValueError as e:
        raise CLIError(f"--tensor-parallel-size {args.tp}: {e}") from None
    if Path(args.model).is_dir():
        try:
            check_checkpoint(args.model, cfg)
        except ValueError as e:
            raise CLIError(f"--model {args.model}: {e}") from None
    return cfg


def weights_label(model: str) -> str:
    """How the benchmarks that time shapes (layer, latency) get their weights, for the results' metadata."""
    if Path(model).is_dir():
        return (
            f"random, in the shapes of {model}/config.json (its checkpoint's tensors and shapes checked, not loaded: "
            "the timing does not depend on the values)"
        )
    return "random (a preset)"


def rank_options(args: argparse.Namespace, *, progress: bool = True) -> RankOptions:
    """The ranks' launch options from the command line, checked (torchrun's world size; the memory that ranks on
    this machine's CPU need)."""
    opts = RankOptions(launcher=args.launcher, tp=args.tp, timeout_s=args.timeout, progress=progress)
    check_launcher(opts)
    check_cpu_memory(args)
    return opts


# a rank's own memory beside its weights and the tensor being generated: Python, torch, gloo (benchmarks/probes/
# cpu_memory_probe.py: 2 ranks building llama3-8b with 2 / 8 layers peaked at 11.1 / 13.9 GB, estimated 11.4 / 14.0)
RANK_BASE_BYTES = 1 << 30


def available_host_memory() -> int | None:
    """Bytes of memory this machine can still hand out (Linux's MemAvailable, within a cgroup v2 limit), or None
    where neither is readable."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def cpu_memory_needed(
    cfg: ModelConfig, dtype: torch.dtype, *, tp: int, local_ranks: int, random_weights: bool
) -> tuple[int, int, int]:
    """(bytes in all, of which weights, per rank beside them) that `local_ranks` of a TP=`tp` build of cfg need on
    one machine's CPU: their share of the weights, plus per rank a base and, for random weights, the largest tensor
    being generated (in fp32, then in the model dtype)."""
    from tpweave.models.weights import full_shapes, weight_bytes

    weights = weight_bytes(cfg, dtype) * local_ranks // tp
    largest = max(math.prod(shape) for shape in full_shapes(cfg).values())
    per_rank = RANK_BASE_BYTES + (largest * (4 + dtype.itemsize) if random_weights else 0)
    return weights + local_ranks * per_rank, weights, per_rank


def check_cpu_memory(args: argparse.Namespace) -> None:
    """CLIError before any rank starts when the ranks would run on this machine's CPU and need more memory than it
    has available (the kernel would kill a rank mid-build), as `cpu_memory_needed` estimates it."""
    from tpweave.models import resolve_config

    if torch.cuda.is_available():
        return
    avail = available_host_memory()
    if avail is None:
        return
    num_layers = getattr(args, "num_layers", None)
    cfg = resolve_config(args.model, **({"num_layers": num_layers} if num_layers else {}))
    local = min(args.tp, int(os.environ.get("LOCAL_WORLD_SIZE", args.tp)))  # ranks on this machine
    need, weights, per_rank = cpu_memory_needed(
        cfg, DTYPES[args.dtype], tp=args.tp, local_ranks=local, random_weights=not Path(args.model).is_dir()
    )
    if need > avail:
        gb = 1e9
        raise CLIError(
            f"--model {args.model}: {local} rank(s) on this machine's CPU need about {need / gb:.1f} GB "
            f"({weights / gb:.1f} GB of {args.dtype} weights, {per_rank / gb:.1f} GB per rank beside them) and "
            f"{avail / gb:.1f} GB is available: use a smaller model (or --num-layers N where the command takes it) "
            "or GPUs"
        )


def cached_table(model: str, tp: int, dtype_name: str):
    """The calibration table measured for this model, TP and dtype on this GPU, or None."""
    from tpweave.models import resolve_config
    from tpweave.tuning.table import load_table, table_key

    return load_table(table_key(resolve_config(model), tp=tp, dtype=DTYPES[dtype_name]))


def check_invariant(args) -> None:
    """--invariant's limits, before any rank starts: the compiled model."""
    if getattr(args, "invariant", None) is None:
        return
    if args.no_compile:
        raise CLIError(f"--invariant {args.invariant} needs the compiled model: drop --no-compile")
