"""`tpweave::select_rows`: the rows of the tokens whose logits are wanted (the last token of each sequence),
as one opaque op, so that engines can cut piecewise CUDA graphs there: before it every shape depends on the
number of tokens M, after it (the LM head) on the number of sequences B."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("tpweave::select_rows", mutates_args=())
def select_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (M, *F), rows (B,) int64 -> x[rows] (B, *F)."""
    return x.index_select(0, rows)


@select_rows.register_fake
def _(x, rows):
    return x.new_empty(rows.shape[0], *x.shape[1:])
