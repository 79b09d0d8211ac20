"""Timing arms against each other the way a performance engineer would trust.

Each arm is a zero-argument callable. On CUDA every arm is captured in its own CUDA graph after a
warm-up (so host overhead is out and symmetric-memory workspaces are sized first), then the arms
are replayed interleaved in a rotating order, `reps` times, each sample timed with CUDA events over
`inner` replays. A sample is the slowest rank's time (an op is done when every rank is done).
On CPU the same loop runs eagerly with wall-clock timers. Results are medians in milliseconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def allow_many_compiles() -> None:
    """Benchmarks compile the same forward once per arm and phase: more than Dynamo's default
    recompile limit, which would silently fall back to eager for the later arms."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)


@dataclass
class ArmTiming:
    """Timing of one arm: median and every sample in ms (each the slowest rank's), and the peak memory its
    warm-up allocated on the GPU in bytes (0 on CPU)."""

    median_ms: float
    samples_ms: list[float]
    peak_mem_bytes: int = 0

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how much to trust the median."""
        if len(self.samples_ms) < 4:
            return 0.0
        q = statistics.quantiles(self.samples_ms, n=4)
        return (q[2] - q[0]) / self.median_ms if self.median_ms else 0.0


def _max_over_ranks(values: list[float], group) -> list[float]:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _barrier(group) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def time_arms(
    arms: dict[str, Callable[[], Any]],
    *,
    group=None,
    reps: int = 10,
    warmup: int = 3,
    inner: int = 5,
    cuda_graphs: bool = True,
) -> dict[str, ArmTiming]:
    """Time each zero-argument arm as the module docstring describes: {name: ArmTiming}. `group` is the
    process group whose ranks run the same arms (None: this process alone); cuda_graphs=False replays eagerly."""
    names = list(arms)
    on_cuda = torch.cuda.is_available() and (group is None or dist.get_backend(group) == "nccl")
    peak: dict[str, int] = {n: 0 for n in names}
    runners: dict[str, Callable[[], Any]] = {}
    for name in names:
        fn = arms[name]
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(warmup):
            fn()
        if on_cuda:
            torch.cuda.synchronize()
            peak[name] = torch.cuda.max_memory_allocated() - base
        if on_cuda and cuda_graphs:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # one more warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            _barrier(group)
            with torch.cuda.graph(graph):
                fn()
            runners[name] = graph.replay
        else:
            runners[name] = fn
        _barrier(group)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            run = runners[name]
            _barrier(group)
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    run()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    run()
                samples[name].append((time.perf_counter() - t0) * 1e3 / inner)
    out = {}
    for name in names:
        s = _max_over_ranks(samples[name], group)
        out[name] = ArmTiming(statistics.median(s), s, peak[name])
    return out
