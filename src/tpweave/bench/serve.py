"""`tpweave bench serve`: an in-process client sends requests with Poisson arrivals to the engine and
measures what a user of a server sees: TTFT, TPOT, inter-token latency (p50/p90/p99), request and
token throughput. Every request is accounted for: finished, or failed with its error.

All TP ranks run the same engine loop; the clock that decides which requests have arrived is rank
0's, broadcast every step, so every rank admits the same requests at the same step.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tpweave.log import progress_bar
from tpweave.runtime.context import TPContext


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token lengths with this median and log-space sigma, rounded and clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    @classmethod
    def from_mean(cls, mean: float, sigma: float, lo: int, hi: int) -> LengthDist:
        """The lognormal whose mean is `mean` (median = mean * exp(-sigma^2 / 2))."""
        return cls(mean * math.exp(-(sigma**2) / 2), sigma, lo, hi)

    def draw(self, rng: random.Random) -> int:
        """One length."""
        return int(min(max(round(rng.lognormvariate(math.log(self.median), self.sigma)), self.lo), self.hi))


# Workloads: (input lengths, output lengths), lognormal around published statistics. The sigma (spread)
# is ours: the sources give central values. Azure LLM inference trace 2023 as reported by Splitwise
# (Patel et al., ISCA 2024): coding prompts median 1500 tokens, outputs median 13; conversation prompts
# median 1020, outputs median 129. ShareGPT as used by vLLM (Kwon et al., SOSP 2023): mean input 161,
# mean output 338 tokens.
WORKLOADS: dict[str, tuple[LengthDist, LengthDist]] = {
    "azure-code": (LengthDist(1500, 0.8, 16, 8000), LengthDist(13, 0.8, 1, 512)),
    "azure-conv": (LengthDist(1020, 0.8, 16, 8000), LengthDist(129, 0.8, 1, 1024)),
    "sharegpt": (LengthDist.from_mean(161, 1.0, 4, 4000), LengthDist.from_mean(338, 1.0, 1, 2048)),
}


@dataclass(frozen=True)
class Request:
    """One request of a workload: arrival time (s from the start of the run), prompt and output lengths in
    tokens."""

    arrival_s: float
    input_len: int
    output_len: int


def poisson_requests(
    *, num_requests: int, rate: float, lengths, seed: int, max_total: int | None = None
) -> list[Request]:
    """num_requests Poisson arrivals at `rate` per second (inf: all at time 0). lengths: (input, output),
    each a LengthDist or a (lo, hi) range drawn uniformly; max_total - 1 caps input + output (the output
    first to max_total - 2, then the input: a context length, minus room for one new token)."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate}, {num_requests}")
    rng = random.Random(seed)

    def draw(dist) -> int:
        return dist.draw(rng) if isinstance(dist, LengthDist) else rng.randint(*dist)

    t, out = 0.0, []
    for _ in range(num_requests):
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        input_len, output_len = draw(lengths[0]), draw(lengths[1])
        if max_total is not None:
            output_len = max(1, min(output_len, max_total - 2))
            input_len = max(1, min(input_len, max_total - 1 - output_len))
        out.append(Request(t, input_len, output_len))
    return out


def load_requests(path: str | Path, *, rate: float, seed: int) -> list[Request]:
    """JSON (a list of objects) or CSV (a header row) with input_len, output_len and optionally
    arrival_s; without arrival_s the requests arrive as a Poisson process at `rate`."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            records = json.loads(path.read_text())
        else:
            with path.open(newline="") as f:
                records = list(csv.DictReader(f))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read requests from {path}: {e}") from e
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: expected a non-empty list of requests with input_len and output_len")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(records):
        try:
            input_len, output_len = int(r["input_len"]), int(r["output_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: request {i} needs integer input_len and output_len ({e})") from e
        if r.get("arrival_s") not in (None, ""):
            t = float(r["arrival_s"])
        else:
            t += rng.expovariate(rate)
        out.append(Request(t, input_len, output_len))
    return sorted(out, key=lambda r: r.arrival_s)


# The engines a serving run compares, by arm name: their EngineConfig fields. The first arm given is the one the
# others' throughput is divided by.
SERVE_ARMS: dict[str, dict[str, Any]] = {
    "baseline": {"baseline": True},  # plain TP: the model's NCCL all-reduces, Inductor's add + norm
    "auto": {},  # tpweave's defaults
    "auto_aa": {},  # the same engine built a second time: the A/A control of the comparison
    "prefill_eager": {"piecewise_graphs": False},  # tpweave's defaults, prefill and mixed steps without CUDA graphs
    "prefill_piecewise": {"whole_step_graphs": False},  # prefill and mixed steps from piecewise graphs, not whole ones
}

PERCENTILES = {"p50": 50, "p90": 90, "p99": 99}


def _percentiles(values: list[float], *, seed: int = 0) -> dict[str, Any]:
    """p50 / p90 / p99 of the values and, for each, a 95% bootstrap interval over the values."""
    out: dict[str, Any] = {}
    if not values:
        return {**{p: None for p in PERCENTILES}, **{f"{p}_ci": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    boots = arr[np.random.default_rng(seed).integers(0, len(arr), size=(1000, len(arr)))]
    for p, q in PERCENTILES.items():
        out[p] = float(np.percentile(arr, q))
        lo, hi = np.percentile(np.percentile(boots, q, axis=1), [2.5, 97.5])
        out[f"{p}_ci"] = [float(lo), float(hi)]
    return out


def summarize(records: list[dict[str, Any]], *, num_sent: int | None = None) -> dict[str, Any]:
    """Latency percentiles (ms, with 95% intervals) and throughputs from per-request records. Finished,
    failed (an error) and lost (sent, then neither finished nor failed: no record, or one marked lost) are
    counted each on its own; they add up to num_sent only when nothing is missing."""
    done = [r for r in records if r["error"] is None and not r.get("lost")]
    failed = [r for r in records if r["error"] is not None]
    lost = [r for r in records if r.get("lost")]
    num_sent = len(records) if num_sent is None else num_sent
    ttft = [1e3 * (r["token_times"][0] - r["arrival_s"]) for r in done if r["token_times"]]
    tpot = [
        1e3 * (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
        for r in done
        if len(r["token_times"]) > 1
    ]
    itl = [1e3 * (b - a) for r in done for a, b in zip(r["token_times"], r["token_times"][1:])]
    start = min((r["arrival_s"] for r in records), default=0.0)
    end = max((r["token_times"][-1] for r in done if r["token_times"]), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(len(r["token_times"]) for r in done)
    in_tokens = sum(r["input_len"] for r in done)
    summary = {
        "num_requests": num_sent,
        "num_finished": len(done),
        "num_failed": len(failed),
        "num_lost": len(lost) + (num_sent - len(records)),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for p, v in _percentiles(values).items():
            summary[f"{name}_{p}"] = v
    return summary


def serve_rows(
    records: dict[tuple, list[dict[str, Any]]], sent: dict[tuple, int], *, arms: list[str], rounds: int
) -> list[dict[str, Any]]:
    """One row per (workload, rate, arm) from records keyed (arm, workload, rate, round): latency
    percentiles over every round's requests (95% intervals), throughputs as the median over rounds, the
    output-throughput ratio to the first arm with its 95% interval (paired by round), and finished /
    failed / lost counts over all rounds."""
    from tpweave.bench.stats import paired_ratio

    rows = []
    for (workload, rate), num in sent.items():
        per_arm = {}
        for arm in arms:
            recs = [records[(arm, workload, rate, rnd)] for rnd in range(rounds)]
            per_round = [summarize(r, num_sent=num) for r in recs]
            pooled = summarize([x for r in recs for x in r], num_sent=num * rounds)
            row = {"what": "serve", "workload": workload, "rate": rate, "arm": arm, "rounds": rounds, **pooled}
            for key in ("request_throughput", "output_token_throughput", "total_token_throughput"):
                row[key] = float(np.median([p[key] for p in per_round]))
                row[f"{key}_rounds"] = [p[key] for p in per_round]
            row.pop("duration_s")
            row["errors"] = sorted({x["error"] for r in recs for x in r if x["error"]})[:5]
            per_arm[arm] = row
        base = per_arm[arms[0]]["output_token_throughput_rounds"]
        for row in per_arm.values():
            ratio = paired_ratio(row["output_token_throughput_rounds"], base) if all(base) else None
            row["vs_baseline"] = ratio.to_dict() if ratio is not None else None
            rows.append(row)
    return rows


class _Clock:
    """Rank 0's seconds since start, the same value on every rank (one tiny broadcast per call)."""

    def __init__(self, ctx: TPContext):
        self.ctx, self.t0 = ctx, time.perf_counter()
        self.buf = torch.zeros(1, dtype=torch.float64, device=ctx.device)

    def now(self) -> float:
        if self.ctx.world_size == 1:
            return time.perf_counter() - self.t0
        self.buf.fill_(time.perf_counter() - self.t0)
        dist.broadcast(self.buf, group=self.ctx.group, group_src=0)
        return float(self.buf.item())


def run_requests(ctx: TPContext, engine, requests: list[Request], *, seed: int) -> list[dict[str, Any]]:
    """Drive the engine with the requests at their arrival times; one record per request."""
    from tpweave.engine import SamplingParams

    rng = random.Random(seed)
    vocab = engine.vocab_size
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    records: list[dict[str, Any]] = []
    active: list[tuple[Any, dict[str, Any]]] = []
    clock = _Clock(ctx)
    progress = None
    if ctx.rank == 0:
        progress = progress_bar(total=len(requests), desc="requests")
    while pending or active:
        now = clock.now()
        while pending and pending[0].arrival_s <= now:
            req = pending.popleft()
            rec = {
                "arrival_s": req.arrival_s,
                "input_len": req.input_len,
                "output_len": req.output_len,
                "token_times": [],
                "error": None,
            }
            records.append(rec)
            prompt = [rng.randrange(vocab) for _ in range(req.input_len)]
            try:
                seq = engine.add_request(prompt, SamplingParams(max_tokens=req.output_len))
                active.append((seq, rec))
            except ValueError as e:
                rec["error"] = str(e)
                if progress is not None:
                    progress.update(1)
        if not active:
            if pending:
                time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        engine.step()
        t = clock.now()
        still = []
        idle = not engine.has_unfinished()
        for seq, rec in active:
            rec["token_times"] += [t] * (len(seq.output_token_ids) - len(rec["token_times"]))
            if seq.error is not None:
                rec["error"] = seq.error
            elif seq.finish_reason is None:
                if idle:  # the engine holds nothing more, yet this request never ended: lost
                    rec["lost"] = True
                else:
                    still.append((seq, rec))
        if progress is not None:
            progress.update(len(active) - len(still))
        active = still
    if progress is not None:
        progress.close()
    return records


def engine_stats(engine, *, build_s: float, steps_before: dict[str, int], peak_step_bytes: int | None) -> dict:
    """What an arm's engine and its graphs cost: build seconds (warm-up included), the captures' seconds and the
    memory they reserved, KV blocks, how the served steps ran (counts by path since `steps_before`) and the padding
    they took, and the peak memory the served steps allocated beyond what the engine held (None without CUDA)."""
    runner = engine.runner
    steps = {k: v - steps_before.get(k, 0) for k, v in runner.step_stats.items()}
    graph_steps = max(steps["piecewise"] + steps["whole_graph"], 1)
    return {
        "build_s": build_s,
        **runner.capture_stats,
        "num_blocks": runner.num_blocks,
        **{f"steps_{k}": v for k, v in steps.items() if k not in ("tokens", "padded_tokens")},
        "padded_tokens_per_step": steps["padded_tokens"] / graph_steps,
        "padded_fraction": steps["padded_tokens"] / max(steps["tokens"], 1),
        "peak_step_bytes": peak_step_bytes,
    }


def release_engine(engine) -> None:
    """Free an engine's KV cache, CUDA graphs and compiled code before the next arm builds its own
    (the caller must drop its reference too)."""
    engine.release()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
