"""Which communication kernels an arm really ran: a torch.profiler trace of a few forwards, kernel
names sorted into categories, counted per forward. An arm whose configuration picks fused or
overlapped strategies but shows none of their kernels fails the run (tpweave.bench.kernels.check).
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
    # tpweave's own communication kernels (ops/strategies/triton_*.py)
    ("tpweave_comm", re.compile(r"_all_reduce_rms_norm(_ll)?_kernel")),
    # torch symm_mem: one/two-shot all-reduce kernels, barriers and signal kernels of the fused ops and
    # of tpweave's ce_overlap, and the copy-engine peer copies of their pipelines
    ("symm_mem", re.compile(r"one_shot|two_shot|multimem|symm|barrier_kernel|put_signal|wait_signal|PtoP|Peer", re.I)),
    ("tpweave_triton", re.compile(r"_paged_decode_kernel|tpweave", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90|nvjet|matmul", re.I)),
)


def categorize(name: str) -> str:
    """Category of a kernel name: the first of CATEGORIES whose pattern matches, else "other"."""
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def profile_kernels(
    fn: Callable[[], Any], *, num_forwards: int = 2, trace_path: str | Path | None = None
) -> dict[str, Any]:
    """Run fn num_forwards times under the profiler; kernel counts per forward by category and by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()  # outside the trace: first-call work
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(num_forwards):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    names: Counter[str] = Counter()
    for evt in prof.events():
        device_type = getattr(evt, "device_type", None)
        # "nccl:all_reduce"-style names are profiler annotations on the GPU timeline, not kernels
        if (
            device_type is not None
            and device_type == torch.autograd.DeviceType.CUDA
            and not evt.name.startswith("nccl:")
        ):
            names[evt.name] += 1
    by_category: Counter[str] = Counter()
    for name, n in names.items():
        by_category[categorize(name)] += n
    per_forward = {k: v / num_forwards for k, v in sorted(by_category.items())}
    comm = {
        k: v / num_forwards
        for k, v in names.items()
        if categorize(k)
        in ("nccl_all_reduce", "nccl_reduce_scatter", "nccl_all_gather", "nccl_other", "symm_mem", "tpweave_comm")
    }
    return {"per_forward": per_forward, "comm_kernels": dict(sorted(comm.items()))}


def expected_categories(arm: str, strategies: set[str], variant: str) -> dict[str, str]:
    """What an arm must show, {category: why}, from what its configuration picked at this M."""
    if arm == "compute_only":
        return {}
    need: dict[str, str] = {}
    ours = {s for s in strategies if s.startswith("triton_")}  # tpweave's own kernels
    torch_symm = strategies - {"sequential"} - ours
    if ours:
        need["tpweave_comm"] = f"strategies {sorted(ours)} at this M"
    if torch_symm:
        need["symm_mem"] = f"strategies {sorted(torch_symm)} at this M"
    if ours or torch_symm:
        pass
    elif variant == "sp":
        need["nccl_reduce_scatter"] = "sequence-parallel graph with plain collectives"
    else:
        need["nccl_all_reduce"] = "plain TP graph with NCCL all-reduce"
    return need


def check(arm: str, counts: dict[str, float], need: dict[str, str], *, forbid_comm: bool = False) -> list[str]:
    """Problems (empty when the arm ran what it should)."""
    problems = [f"{arm}: no {cat} kernels ran ({why})" for cat, why in need.items() if counts.get(cat, 0) == 0]
    if forbid_comm:
        comm = {k: v for k, v in counts.items() if k.startswith("nccl") or k == "symm_mem"}
        if comm:
            problems.append(f"{arm}: communication kernels ran in the compute-only arm: {comm}")
    return problems
