"""Checks every command makes before any rank starts, and what several commands share."""

from __future__ import annotations

import argparse

from tpweave.cli.errors import CLIError
from tpweave.cli.ranks import RankOptions, check_launcher
from tpweave.models.config import DTYPES, ModelConfig


def model_config(args: argparse.Namespace, **overrides) -> ModelConfig:
    """The --model's config (with overrides), checked against --tensor-parallel-size; CLIError naming the flag."""
    from tpweave.models import resolve_config

    try:
        cfg = resolve_config(args.model, **overrides)
    except (ValueError, TypeError) as e:
        raise CLIError(f"--model {args.model}: {e}") from None
    try:
        cfg.check_tp(args.tp)
    except ValueError as e:
        raise CLIError(f"--tensor-parallel-size {args.tp}: {e}") from None
    return cfg


def rank_options(args: argparse.Namespace, *, progress: bool = True) -> RankOptions:
    """The ranks' launch options from the command line, checked (torchrun's world size)."""
    opts = RankOptions(launcher=args.launcher, tp=args.tp, timeout_s=args.timeout, progress=progress)
    check_launcher(opts)
    return opts


def cached_table(model: str, tp: int, dtype_name: str):
    """The calibration table measured for this model, TP and dtype on this GPU, or None."""
    from tpweave.models import resolve_config
    from tpweave.tuning.table import load_table, table_key

    return load_table(table_key(resolve_config(model), tp=tp, dtype=DTYPES[dtype_name]))
