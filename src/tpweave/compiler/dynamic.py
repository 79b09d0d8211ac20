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


def mark_tokens_dynamic(tensors: Iterable[object], *, dim: int = 0) -> None:
    """Mark the token dim of every tensor argument dynamic where it has 2 or more entries (non-tensors
    and 0-d tensors are skipped). Not enforced: where the model's code needs the exact size, Dynamo
    specializes it (a recompile per size, noted in the report once the recompile limit is reached)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, dim)
