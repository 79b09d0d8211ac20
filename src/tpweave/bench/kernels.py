"""Proof of what an arm ran: a torch.profiler trace of the CUDA graph that was timed, at every M, its
communication kernels counted against what the compiled graph's sites chose at that M.

Every collective site of a compiled graph is either a plain collective (an all-reduce the plain graph
kept, a reduce-scatter or all-gather the SP pass inserted and async TP left alone) or a
strategy-dispatched op with a policy (GraphReport.dispatched). At a given M each picks one strategy,
and each strategy has a signature: the kernel category it launches and how many of them per call.
The expected count of every communication category is the sum over sites; the observed count must
equal it (strategies whose kernel count per call depends on torch's internals, torch's fused ops and
tpweave's copy-engine pipelines, must show at least one of their kernels). Categories nothing chose
must not appear: compute_only runs no communication at all, plain arms no reduce-scatter, all-gather
or overlap kernels.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
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
    # torch symm_mem's barriers and signal kernels (its fused ops, tpweave's ce_overlap), and the
    # copy-engine peer copies of their pipelines
    ("symm_mem", re.compile(r"multimem|symm|barrier_kernel|put_signal|wait_signal|PtoP|Peer", re.I)),
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
    "symm_mem",
)
# (strategy, op kind) -> (category, kernels per call; None: at least one). Kinds not listed take the
# strategy's "*" entry.
SIGNATURES: dict[tuple[str, str], tuple[str, int | None]] = {
    ("sequential", "all_reduce"): ("nccl_all_reduce", 1),
    ("sequential", "all_reduce_rms_norm"): ("nccl_all_reduce", 1),
    ("sequential", "ag_mm"): ("nccl_all_gather", 1),
    ("sequential", "ag_scaled_mm"): ("nccl_all_gather", 2),  # the FP8 rows and their scales
    ("sequential", "mm_rs"): ("nccl_reduce_scatter", 1),
    ("sequential", "mm_rs_rms_norm"): ("nccl_reduce_scatter", 1),
    ("sequential", "scaled_mm_rs"): ("nccl_reduce_scatter", 1),
    ("symm_mem_one_shot", "*"): ("symm_mem_one_shot", 1),
    ("symm_mem_two_shot", "*"): ("symm_mem_two_shot", 1),
    ("triton_ar_norm", "*"): ("tpweave_ar_norm", 1),
    ("triton_ar_norm_ll", "*"): ("tpweave_ar_norm_ll", 1),
    ("symm_mem_fused", "*"): ("symm_mem", None),
    ("ce_overlap", "*"): ("symm_mem", None),
    ("ce_overlap_2s", "*"): ("symm_mem", None),
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


def expected_comm(
    graph_report: dict,
    num_tokens: int,
    *,
    world_size: int = 2,
    available: Callable[[str], bool] = lambda name: True,
) -> dict[str, tuple[int | None, list[str]]]:
    """{category: (expected kernels per call, or None for "at least one"; the sites behind it)} of one
    compiled graph (GraphReport.to_dict()) at M = num_tokens. A strategy that is not `available` counts as
    `sequential`, which the dispatched op runs in its place. With one rank, NCCL collectives and tpweave's
    two-shot path launch no kernel (nothing to exchange; measured on one H200); torch's one-shot kernel
    and tpweave's own kernels still run."""
    from tpweave.ops.strategies import chosen_name

    expected: dict[str, tuple[int | None, list[str]]] = {}
    silent_alone = {"nccl_all_reduce", "nccl_reduce_scatter", "nccl_all_gather", "symm_mem_two_shot"}

    def add(category: str, count: int | None, why: str) -> None:
        if world_size == 1 and category in silent_alone:
            return
        have, whys = expected.get(category, (0, []))
        total = None if count is None or have is None else have + count
        expected[category] = (total, [*whys, why])

    for collective, n in graph_report["counts_after"].items():
        if collective in PLAIN_COLLECTIVES:
            category, per = PLAIN_COLLECTIVES[collective]
            add(category, per * n, f"{n} plain {collective}")
    for kind, policy in graph_report["dispatched"]:
        name = chosen_name(policy, num_tokens)
        name = name if available(name) else "sequential"
        category, per = SIGNATURES.get((name, kind)) or SIGNATURES[(name, "*")]
        add(category, per, f"{kind} -> {name}")
    return expected


def prove(arm: str, observed: dict[str, float], expected: dict[str, tuple[int | None, list[str]]]) -> list[str]:
    """Problems (empty: the arm ran exactly what its sites chose). `observed`: kernels per call by category."""
    problems = []
    for category in COMM_CATEGORIES:
        got = observed.get(category, 0)
        count, whys = expected.get(category, (0, []))
        sites = ", ".join(sorted(set(whys)))
        if count is None:
            if got == 0:
                problems.append(f"{arm}: no {category} kernels ran, but sites chose them ({sites})")
        elif got != count:
            why = f" (sites: {sites})" if sites else " (no site chose this category)"
            problems.append(f"{arm}: {got:g} {category} kernels per call, expected {count}{why}")
    return problems
