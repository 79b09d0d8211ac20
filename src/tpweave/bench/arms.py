"""The arms every benchmark times in one run, and the rows, ratios and proofs made from their timings.

Arms (each compiled separately, strict: a pass failure fails the run):
- plain_nccl: plain TP, the model's NCCL all-reduces, Inductor's own add + norm (PLAIN_TP).
- plain_best: what torch gives without tpweave: the plain TP graph with, per M, the fastest of
  NCCL, torch's symm-mem one-shot and two-shot all-reduce (the candidates plain_nccl, plain_one_shot,
  plain_two_shot are all timed; plain_best is the fastest at each M), Inductor's own add + norm.
- sp_seq: sequence parallel with plain collectives; sp_fused: SP + torch's fused AG+MM / MM+RS.
- token_split: the plain graph as two token subsets whose all-reduces (+ residual + RMSNorm, fused on a few SMs
  on a side stream: CompileOptions.token_split_sms) overlap the other subset's compute (compiler/token_split.py),
  from M = 4 on (below it the plain graph).
- auto: tpweave as users run it (the calibrated table); auto_aa: auto compiled and captured a second
  time, the A/A control: any difference between auto and auto_aa is the harness's noise or bias.
- compute_only: the same shards without any communication: the limit.

Headline ratios are auto vs plain_best, with auto vs plain_nccl beside them; every ratio carries a
95% interval (bench/stats.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tpweave import compiler
from tpweave.bench.kernels import expected_comm, profile_kernels, prove
from tpweave.bench.stats import aa_check, median, paired_ratio, within_aa_noise
from tpweave.compiler import PLAIN_TP, CompileOptions
from tpweave.ops.strategies import STRATEGIES

PLAIN_ALL_REDUCES = {
    "plain_nccl": "sequential",
    "plain_one_shot": "symm_mem_one_shot",
    "plain_two_shot": "symm_mem_two_shot",
}
ARMS = ("plain_best", "sp_seq", "sp_fused", "token_split", "auto", "auto_aa", "compute_only")
TOKEN_SPLIT_MIN_TOKENS = 4


def plain_candidates(probe: torch.Tensor) -> dict[str, str]:
    """The plain arms whose all-reduce can run for tensors like `probe` (NCCL always)."""
    return {arm: name for arm, name in PLAIN_ALL_REDUCES.items() if STRATEGIES[name].available(probe)}


def arm_options(arm: str, *, table, fused: str) -> CompileOptions:
    """The compile options of an arm (compute_only: those of a plain graph of the communication-free twin)."""
    if arm in PLAIN_ALL_REDUCES:
        return PLAIN_TP.replace({"all_reduce_policy": PLAIN_ALL_REDUCES[arm], "strict": True})
    options = {
        "sp_seq": CompileOptions(sp=True, sp_min_tokens=0, async_tp=False, table=None, strict=True),
        "sp_fused": CompileOptions(
            sp=True, sp_min_tokens=0, ag_mm_policy=fused, mm_rs_policy=fused, table=None, strict=True
        ),
        "token_split": PLAIN_TP.replace({"token_split_min_tokens": TOKEN_SPLIT_MIN_TOKENS, "strict": True}),
        "auto": CompileOptions(table=table, strict=True),  # tpweave.compile's defaults
        "auto_aa": CompileOptions(table=table, strict=True),
        "compute_only": CompileOptions(sp=False, table=None, strict=True),
    }
    return options[arm]


def compile_arms(
    module: torch.nn.Module, compute_module: torch.nn.Module, *, device: torch.device, dtype: torch.dtype, table,
    arms: tuple[str, ...] = ARMS,
) -> dict[str, compiler.CompiledTP]:  # fmt: skip
    """{timed arm: compiled module}; plain_best expands into its available candidates."""
    probe = torch.empty(0, device=device, dtype=dtype)
    fused = "symm_mem_fused" if STRATEGIES["symm_mem_fused"].available(probe) else "sequential"
    if device.type == "cuda" and fused != "symm_mem_fused":
        raise RuntimeError("torch's symm_mem fused ops are not available: the sp_fused arm would not measure them")
    timed = [a for arm in arms for a in (plain_candidates(probe) if arm == "plain_best" else [arm])]
    return {
        arm: compiler.compile(compute_module if arm == "compute_only" else module,
                              options=arm_options(arm, table=table, fused=fused))
        for arm in timed
    }  # fmt: skip


def arm_rows(timings, *, scale: float = 1.0, key: dict[str, Any], seed: int = 0) -> list[dict[str, Any]]:
    """One row per timed arm and one for plain_best: medians (x scale), raw samples, the ratio to plain_best
    and to plain_nccl with 95% intervals, the share of plain_best's communication hidden, and on auto's
    row the A/A control."""
    candidates = [a for a in PLAIN_ALL_REDUCES if a in timings]
    best = min(candidates, key=lambda a: timings[a].median_ms) if candidates else None
    samples = {arm: t.samples_ms for arm, t in timings.items()}
    groups = next((t.groups for t in timings.values() if t.groups), None)  # the capture of each repetition
    if best is not None:
        samples["plain_best"] = samples[best]
    comp = median(samples["compute_only"]) if "compute_only" in samples else None
    rows = []
    for arm, s in samples.items():
        t_arm = median(s)
        row = {**key, "arm": arm, "ms": t_arm * scale, "samples_ms": [v * scale for v in s],
               "spread": timings[best if arm == "plain_best" else arm].spread,
               "peak_mem_bytes": timings[best if arm == "plain_best" else arm].peak_mem_bytes}  # fmt: skip
        if arm == "plain_best":
            row["chosen"] = best
        for base in ("plain_best", "plain_nccl"):
            if base in samples:
                row[f"vs_{base}"] = paired_ratio(samples[base], s, seed=seed, groups=groups).to_dict()
        if "plain_best" in samples and comp is not None:
            gap = median(samples["plain_best"]) - comp
            row["hidden"] = (median(samples["plain_best"]) - t_arm) / gap if gap > 0 else None
            row["of_compute_only"] = comp / t_arm
        if arm == "auto" and "auto_aa" in samples:
            row["aa"] = aa_check(samples["auto"], samples["auto_aa"], seed=seed, groups=groups)
        rows.append(row)
    _within_aa_noise(rows)
    return rows


def _within_aa_noise(rows: list[dict[str, Any]]) -> None:
    """Every row of one M measured against that M's A/A control (bench/stats.py, within_aa_noise)."""
    aa = next((r["aa"] for r in rows if "aa" in r), None)
    for row in rows:
        within_aa_noise(row, aa)


def prove_arms(
    compiled: dict[str, compiler.CompiledTP],
    runners: dict[str, Callable],
    num_tokens: int,
    *,
    probe: torch.Tensor,
    world_size: int,
) -> tuple[dict[str, Any], list[str]]:
    """Profile every arm's timed runner (its CUDA graph) at this M and check its communication kernels
    against its sites' choices (bench/kernels.py). ({arm: kernels seen and the proof's status}, problems);
    nothing on CPU (no profile: the results say "n/a")."""
    kernels, problems = {}, []
    if probe.device.type != "cuda":
        return kernels, problems
    for arm, runner in runners.items():
        seen = profile_kernels(runner)
        kernels[arm] = seen
        graph = compiled[arm].graph_report_for(num_tokens)
        if graph is None:
            problems.append(f"M={num_tokens} {arm}: no compiled graph serves this M (it ran uncompiled)")
            seen["proof"] = "failed"
            continue
        available = lambda n: STRATEGIES[n].available(probe)  # noqa: E731
        expected = expected_comm(graph.to_dict(), num_tokens, world_size=world_size, available=available)
        proof = prove(arm, seen["per_call"], expected)
        seen["proof"] = proof.status
        seen["expected"] = {k: {"count": e.count, "exact": e.exact} for k, e in expected.items()}
        problems += [f"M={num_tokens} {p}" for p in proof.problems]
    return kernels, problems


def fallbacks(compiled: dict[str, compiler.CompiledTP]) -> list[str]:
    """Every arm's compile fallbacks (a pass or Inductor failure, graph breaks, a reached recompile limit)."""
    return [f"{arm}: {note}" for arm, c in compiled.items() for note in c.compile_report.fallbacks()]


def compile_reports(compiled: dict[str, compiler.CompiledTP]) -> dict[str, dict]:
    """Each arm's compile report, JSON-ready."""
    return {arm: c.compile_report.to_dict() for arm, c in compiled.items()}
