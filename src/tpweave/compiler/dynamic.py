"""One compiled graph for every token count M >= 2, one more where a token dim is 1.

tpweave marks token dims dynamic, but a dim of size 1 stays static: Dynamo compiles a graph
specialized to it (decode of one sequence, seq = 1 of a (batch, seq) model). Dynamo's
`backed_size_oblivious` would let one graph serve size 1 too, but it changes the semantics there on
purpose (a size that may be 1 is assumed not to broadcast, strides of size-1 dims are trusted), and
Inductor then computes wrong numbers for some models at seq = 1 (Hugging Face gpt_oss and llama4_text
under torch 2.13 and 2.14). With Dynamo's ordinary guards a dynamic size is >= 2, so a graph traced
for it is never reused where it would be wrong. Duck sizing is off: equal sizes in one call (batch ==
seq) would otherwise become one symbol, and a recompile when they differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.fx.experimental._config as fx_config


def token_dynamic_config() -> contextlib.AbstractContextManager:
    """Context manager for compiling with dynamic token dims: Dynamo's duck sizing off (module docstring)."""
    return fx_config.patch(use_duck_shape=False)


# Inductor picks a kernel's configuration from the size hints of its dims, and a dynamic dim's hint is the size it
# had in the first call: two compiles of one model whose first calls differ in M (two engines with other token
# budgets, two processes) could pick another block of rows per program for a reduction (a norm over a hidden size
# <= 1024 once the hint reaches 1024 rows) and so sum a row in another order. Batch-invariant compiles give every
# token dim this hint instead, below that threshold, so a row is reduced the same way in every compile (and as in the
# graph of one row).
INVARIANT_TOKEN_HINT = 256


def mark_tokens_dynamic(tensors: Iterable[object], *, dim: int = 0, hint: int | None = None) -> None:
    """Mark the token dim of every tensor argument dynamic where it has 2 or more entries (non-tensors
    and 0-d tensors are skipped). Not enforced: where the model's code needs the exact size, Dynamo
    specializes it (a recompile per size, noted in the report once the recompile limit is reached).
    `hint`: the size Inductor's heuristics see for the dim instead of the first call's (torch.compile's
    `mark_dynamic(..., hint_override=hint)`, which `maybe_mark_dynamic` does not take: the same attribute)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, dim)
            if hint is not None:
                if not hasattr(t, "_dynamo_hint_overrides"):
                    t._dynamo_hint_overrides = {}
                t._dynamo_hint_overrides[dim] = hint
