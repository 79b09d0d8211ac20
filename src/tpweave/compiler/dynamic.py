"""One compiled graph for every token count M.

Dynamo specializes sizes 0 and 1 by default, so M=1 (decode of one sequence) or M < TP would each
cost a recompile. With `backed_size_oblivious` the token dim stays one symbol from M=1 upwards.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.fx.experimental._config as fx_config


def token_dynamic_config() -> contextlib.AbstractContextManager:
    return fx_config.patch(backed_size_oblivious=True)


def mark_tokens_dynamic(tensors: Iterable[object], *, dim: int = 0) -> None:
    """Mark the token dim of every tensor argument dynamic (non-tensors and 0-d tensors are skipped)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > dim:
            torch._dynamo.mark_dynamic(t, dim)
