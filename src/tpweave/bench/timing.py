"""Timing arms against each other the way a performance engineer would trust.

Each arm is a zero-argument callable. On CUDA every arm is captured in `captures` CUDA graphs of its own
after a warm-up (so host overhead is out and symmetric-memory workspaces are sized first; two captures of
one graph differ by more than the replays of one), then in each of `reps` repetitions every arm runs once,
repetition i replaying capture i % captures, in an order shuffled per repetition (seeded, recorded), each
sample timed with CUDA events over `inner` replays. A sample is the slowest rank's time (an op is done
when every rank is done). On CPU the same loop runs eagerly with wall-clock timers. Every raw sample is
kept: bench/stats.py pairs them by repetition for the intervals.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@contextlib.contextmanager
def many_compiles(recompile_limit: int = 64, accumulated: int = 1024):
    """Raise Dynamo's recompile limits while benchmarks compile one forward per arm and size class:
    every arm's graphs of one module class share one code object's limit, and past it Dynamo runs the
    later arms eagerly without a word (the compile reports would show "recompile limit")."""
    config = torch._dynamo.config
    with config.patch(
        recompile_limit=max(config.recompile_limit, recompile_limit),
        accumulated_recompile_limit=max(config.accumulated_recompile_limit, accumulated),
    ):
        yield


@dataclass
class ArmTiming:
    """One arm's samples (ms per call, the slowest rank's, one per repetition in repetition order) and the
    peak memory its warm-up allocated."""

    samples_ms: list[float]
    peak_mem_bytes: int = 0
    groups: list[int] | None = None  # the capture each sample replayed (bench/stats.py: hierarchical intervals)

    @property
    def median_ms(self) -> float:
        """Median of the samples."""
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 for fewer than 2 samples): how much to trust the median."""
        if len(self.samples_ms) < 2 or not self.median_ms:
            return 0.0
        q1, q3 = np.percentile(self.samples_ms, [25, 75])
        return float((q3 - q1) / self.median_ms)


class Timings(dict):
    """{arm: ArmTiming}, with the arm order of every repetition (`orders`), the seed that shuffled them,
    and each arm's runner (its first CUDA graph's replay, or the callable on CPU) for a kernel check of what was
    timed, and how many captures each arm had."""

    def __init__(self, arms: dict[str, ArmTiming], *, orders: list[list[str]], seed: int, runners: dict, captures=1):
        super().__init__(arms)
        self.orders, self.seed, self.runners, self.captures = orders, seed, runners, captures


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


def capture(fn: Callable[[], Any], group) -> Callable[[], Any]:
    """fn captured in a CUDA graph after one more warm-up on the capture stream; its replay."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    _barrier(group)
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_arms(
    arms: dict[str, Callable[[], Any]],
    *,
    group=None,
    reps: int = 10,
    warmup: int = 3,
    inner: int = 5,
    cuda_graphs: bool = True,
    seed: int = 0,
    captures: int = 3,
) -> Timings:
    """Every arm warmed up (and on CUDA captured in `captures` CUDA graphs of its own), then `reps` repetitions in
    each of which every arm runs once (repetition i replays capture i % captures), in an order shuffled per
    repetition by a generator seeded with `seed` (the same on every rank); a sample is `inner` calls timed
    together, per call, the slowest rank's time."""
    if captures < 1:
        raise ValueError(f"captures must be >= 1, got {captures}")
    names = list(arms)
    on_cuda = torch.cuda.is_available() and (group is None or dist.get_backend(group) == "nccl")
    peak: dict[str, int] = {n: 0 for n in names}
    runners: dict[str, list[Callable[[], Any]]] = {}
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
        runners[name] = [capture(fn, group) for _ in range(captures)] if on_cuda and cuda_graphs else [fn]
        _barrier(group)
    num_captures = len(next(iter(runners.values()))) if runners else 1
    rng = random.Random(seed)
    orders: list[list[str]] = []
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            samples[name].append(time_call(runners[name][i % num_captures], inner=inner, on_cuda=on_cuda, group=group))
    groups = [i % num_captures for i in range(reps)]
    out = {name: ArmTiming(_max_over_ranks(samples[name], group), peak[name], groups) for name in names}
    first = {name: runs[0] for name, runs in runners.items()}
    return Timings(out, orders=orders, seed=seed, runners=first, captures=num_captures)


def time_call(run: Callable[[], Any], *, inner: int, on_cuda: bool, group=None) -> float:
    """Milliseconds per call of run, over `inner` calls back to back (CUDA events on the GPU), after a barrier
    of `group` (None: none)."""
    _barrier(group)
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        run()
    return (time.perf_counter() - t0) * 1e3 / inner
