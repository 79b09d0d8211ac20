"""The step sizes the engine captures CUDA graphs for, and which one serves a step.

Decode steps (one new token per sequence) replay a whole-forward graph per batch-size bucket. Prefill and
mixed steps replay piecewise graphs per token-count bucket (compiler/piecewise.py), the step padded up to
its bucket: every multiple of 16 up to 256 tokens, then 8 buckets per doubling (multiples of 32 up to 512,
of 64 up to 1024, ...: at most 1/8 of a step is padding past 256 tokens, 15 rows below), and the batch-token
limit itself; like serving engines' capture sizes, finer where a step is short and host-bound.
"""

from __future__ import annotations

import bisect

MIN_PREFILL_BUCKET = 16
BUCKETS_PER_DOUBLING = 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured decode graph: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts with captured piecewise graphs, up to max_num_batched_tokens (module doc)."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    sizes = list(range(MIN_PREFILL_BUCKET, min(256, max_num_batched_tokens) + 1, MIN_PREFILL_BUCKET))
    low = 256
    while low < max_num_batched_tokens:
        step = low // BUCKETS_PER_DOUBLING
        sizes += [m for m in range(low + step, 2 * low + 1, step) if m <= max_num_batched_tokens]
        low *= 2
    return sorted(set(sizes + [max_num_batched_tokens]))


def bucket_for(buckets: list[int], size: int) -> int | None:
    """The smallest bucket >= size (buckets sorted ascending), None when size exceeds them all."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else None


def check_sizes(sizes: tuple[int, ...] | list[int], limit: int, name: str) -> list[int]:
    """sorted(set(sizes)) if every size is an integer in [1, limit]; else ValueError naming `name`."""
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= limit]
    if bad or not sizes:
        raise ValueError(f"{name} must be integers in [1, {limit}], got {list(sizes)!r}")
    return sorted(set(sizes))
