"""Proof of what an arm ran: a torch.profiler trace of the CUDA graph that was timed, at every M, its
communication kernels counted against what the compiled graph's sites chose at that M.

Every collective site of a compiled graph is either a plain collective (an all-reduce the plain graph
kept, a reduce-scatter or all-gather the SP pass inserted and async TP left alone) or a
strategy-dispatched op with a policy (GraphReport.dispatched). At a given M each picks one strategy,
and each strategy has a signature: per call, the kernels of each category it launches, exactly (NCCL,
one-/two-shot, tpweave's fused all-reduce + norm) or at least (torch's fused ops and tpweave's copy-engine
pipelines, whose count depends on torch's internals: their barrier / signal kernels, and a peer copy per
peer). The expectation of a category sums its sites; a category no site chose must not appear (compute_only
runs no communication at all, plain arms no reduce-scatter, all-gather or overlap kernels). A site that
fell back to `sequential` shows as NCCL kernels where none are expected, or as fewer signal kernels than its
sites need where NCCL launches nothing (one rank).

A proof is "proved" only when something was expected and everything matched; an arm that expected no
kernel at all (one rank: NCCL and two-shot launch nothing) is "n/a": it certifies nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Kernel (or copy) names of each category on CUDA; checked in order, first match wins.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    ("nccl_all_reduce", re.compile(r"nccl.*AllReduce", re.I)),
    ("nccl_reduce_scatter", re.compile(r"nccl.*ReduceScatter", re.I)),
    ("nccl_all_gather", re.compile(r"nccl.*AllGather", re.I)),
    ("nccl_other", re.compile(r"nccl", re.I)),
    # tpweave's own fused all-reduce + norm kernels (ops/strategies/triton_ar_norm.py)
    ("tpweave_ar_norm_ll", re.compile(r"_all_reduce_rms_norm_ll_kernel")),
    ("tpweave_ar_norm", re.compile(r"_all_reduce_rms_norm_kernel")),
    ("symm_mem_one_shot", re.compile(r"one_shot_all_reduce", re.I)),
    ("symm_mem_two_shot", re.compile(r"two_shot_all_reduce", re.I)),
    # the copy-engine peer copies of torch's fused ops and tpweave's ce_overlap
    ("peer_copy", re.compile(r"PtoP|Peer", re.I)),
    # torch symm_mem's barriers and signal kernels (its fused ops, tpweave's ce_overlap)
    ("symm_mem_signal", re.compile(r"multimem|symm|barrier_kernel|put_signal|wait_signal", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|_decode_kernel|_merge_kernel", re.I)),  # ops/paged_decode.py
    ("tpweave_triton", re.compile(r"tpweave", re.I)),
    # cuBLAS (its split-K reductions included) and tpweave's GEMV (ops/gemv.py)
    ("gemm", re.compile(r"gemm|cutlass|sm90|nvjet|matmul|splitKreduce|_gemv_kernel", re.I)),
)
COMM_CATEGORIES = (
    "nccl_all_reduce",
    "nccl_reduce_scatter",
    "nccl_all_gather",
    "nccl_other",
    "tpweave_ar_norm_ll",
    "tpweave_ar_norm",
    "symm_mem_one_shot",
    "symm_mem_two_shot",
    "symm_mem_signal",
    "peer_copy",
)
PEERS = -1  # a kernel count of "one per peer": world size - 1
# (strategy, op kind) -> ((category, kernels per call (PEERS: one per peer), exact; else at least), ...). Kinds not
# listed take the strategy's "*" entry. The lower bounds of torch's fused ops are below what they launched on one
# H200 and on 2x H200 (17 barrier kernels for 8 sites at TP=1, benchmarks/results/2026-12-02/layer-*-tp1-*.json;
# 112 and a peer copy each for 32 sites at TP=2, 2026-12-01/latency-*-tp2-*.json).
SIGNATURES: dict[tuple[str, str], tuple[tuple[str, int, bool], ...]] = {
    ("sequential", "all_reduce"): (("nccl_all_reduce", 1, True),),
    ("sequential", "all_reduce_rms_norm"): (("nccl_all_reduce", 1, True),),
    ("sequential", "ag_mm"): (("nccl_all_gather", 1, True),),
    ("sequential", "ag_scaled_mm"): (("nccl_all_gather", 2, True),),  # the FP8 rows and their scales
    ("sequential", "mm_rs"): (("nccl_reduce_scatter", 1, True),),
    ("sequential", "mm_rs_rms_norm"): (("nccl_reduce_scatter", 1, True),),
    ("sequential", "scaled_mm_rs"): (("nccl_reduce_scatter", 1, True),),
    ("symm_mem_one_shot", "*"): (("symm_mem_one_shot", 1, True),),
    ("symm_mem_two_shot", "*"): (("symm_mem_two_shot", 1, True),),
    ("triton_ar_norm", "*"): (("tpweave_ar_norm", 1, True),),
    ("triton_ar_norm_ll", "*"): (("tpweave_ar_norm_ll", 1, True),),
    ("symm_mem_fused", "*"): (("symm_mem_signal", 2, False), ("peer_copy", PEERS, False)),
    # its pushes write peers' memory through mapped pointers: how the profiler names them is not yet recorded
    ("ce_overlap", "*"): (("symm_mem_signal", 1, False),),
    ("ce_overlap_2s", "*"): (("symm_mem_signal", 1, False),),
}
# Collectives of the graph that no policy picks (GraphReport.counts_after) -> (category, kernels each).
PLAIN_COLLECTIVES = {
    "all_reduce_rms_norm_split": ("tpweave_ar_norm", 1),  # token split: the fused kernel on a side stream
    "all_reduce": ("nccl_all_reduce", 1),
    "reduce_scatter_tokens": ("nccl_reduce_scatter", 1),
    "all_gather_tokens": ("nccl_all_gather", 1),
    "all_gather_into_tensor": ("nccl_all_gather", 1),
    "reduce_scatter_tensor": ("nccl_reduce_scatter", 1),
}


def categorize(name: str) -> str:
    """Category of a kernel name: the first of CATEGORIES whose pattern matches, else "other"."""
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def profile_kernels(
    fn: Callable[[], Any], *, num_calls: int = 2, trace_path: str | Path | None = None
) -> dict[str, Any]:
    """Run fn (e.g. a timed CUDA graph's replay) num_calls times under the profiler: kernels per call
    by category ("per_call") and the communication kernels by name ("comm_kernels")."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()  # outside the trace: first-call work
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(num_calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    names: Counter[str] = Counter()
    for evt in prof.events():
        # "nccl:all_reduce"-style names are profiler annotations on the GPU timeline, not kernels
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and not evt.name.startswith("nccl:"):
            names[evt.name] += 1
    by_category: Counter[str] = Counter()
    for name, n in names.items():
        by_category[categorize(name)] += n
    comm = {k: v / num_calls for k, v in names.items() if categorize(k) in COMM_CATEGORIES}
    return {
        "per_call": {k: v / num_calls for k, v in sorted(by_category.items())},
        "comm_kernels": dict(sorted(comm.items())),
    }


@dataclass(frozen=True)
class Expectation:
    """Kernels of one category per call: exactly `count`, or at least `count` (exact=False); the sites behind it."""

    count: int
    exact: bool
    sites: tuple[str, ...]


@dataclass(frozen=True)
class Proof:
    """What one arm's trace at one M proved: "proved" (something was expected and everything matched), "n/a"
    (nothing was expected: it certifies nothing) or "failed" (then `problems` says what)."""

    status: str
    problems: tuple[str, ...] = ()


def expected_comm(
    graph_report: dict,
    num_tokens: int,
    *,
    world_size: int = 2,
    available: Callable[[str], bool] = lambda name: True,
) -> dict[str, Expectation]:
    """{category: Expectation} of one compiled graph (GraphReport.to_dict()) at M = num_tokens: per site the
    signature of the strategy its policy chose at this M. A strategy that is not `available` counts as
    `sequential`, which the dispatched op runs in its place. With one rank, NCCL collectives, tpweave's two-shot
    path and peer copies launch no kernel (nothing to exchange; measured on one H200); torch's one-shot kernel,
    symmetric-memory barriers and tpweave's own kernels still run."""
    from tpweave.ops.strategies import chosen_name

    expected: dict[str, Expectation] = {}
    silent_alone = {"nccl_all_reduce", "nccl_reduce_scatter", "nccl_all_gather", "symm_mem_two_shot", "peer_copy"}

    def add(category: str, count: int, exact: bool, why: str) -> None:
        if world_size == 1 and category in silent_alone:
            return
        have = expected.get(category, Expectation(0, True, ()))
        expected[category] = Expectation(have.count + count, have.exact and exact, (*have.sites, why))

    for collective, n in graph_report["counts_after"].items():
        if collective in PLAIN_COLLECTIVES:
            category, per = PLAIN_COLLECTIVES[collective]
            add(category, per * n, True, f"{n} plain {collective}")
    for kind, policy in graph_report["dispatched"]:
        name = chosen_name(policy, num_tokens)
        name = name if available(name) else "sequential"
        for category, per, exact in SIGNATURES.get((name, kind)) or SIGNATURES[(name, "*")]:
            add(category, world_size - 1 if per == PEERS else per, exact, f"{kind} -> {name}")
    return expected


def prove(arm: str, observed: dict[str, float], expected: dict[str, Expectation]) -> Proof:
    """The arm's proof (`Proof`) from `observed` (kernels per call by category) against `expected`."""
    problems = []
    for category in COMM_CATEGORIES:
        got = observed.get(category, 0)
        want = expected.get(category)
        if want is None:
            if got:
                problems.append(f"{arm}: {got:g} {category} kernels per call, expected 0 (no site chose this category)")
            continue
        sites = ", ".join(sorted(set(want.sites)))
        if want.exact and got != want.count:
            problems.append(f"{arm}: {got:g} {category} kernels per call, expected {want.count} (sites: {sites})")
        elif not want.exact and got < want.count:
            problems.append(
                f"{arm}: {got:g} {category} kernels per call, expected at least {want.count} (sites: {sites}; a site "
                "that fell back launches none)"
            )
    if problems:
        return Proof("failed", tuple(problems))
    return Proof("proved" if any(e.count > 0 for e in expected.values()) else "n/a")
