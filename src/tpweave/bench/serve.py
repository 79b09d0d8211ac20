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
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpweave.runtime.context import TPContext

# (input length range, output length range), uniform within each range
WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "prefill-heavy": ((1024, 4096), (8, 32)),
    "decode-heavy": ((64, 256), (128, 512)),
    "mixed": ((256, 2048), (32, 256)),
}


@dataclass(frozen=True)
class Request:
    """One request of a workload: arrival time (s from the start of the run), prompt and output lengths in
    tokens."""

    arrival_s: float
    input_len: int
    output_len: int


def poisson_requests(
    *, num_requests: int, rate: float, lengths: tuple[tuple[int, int], tuple[int, int]], seed: int
) -> list[Request]:
    """`num_requests` requests arriving as a Poisson process of `rate` per second, lengths uniform within
    the (input, output) ranges of `lengths`; deterministic for a given `seed`."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate}, {num_requests}")
    rng = random.Random(seed)
    (in_lo, in_hi), (out_lo, out_hi) = lengths
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(Request(t, rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)))
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


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p90": q[89], "p99": q[98]}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Latency percentiles (ms) and throughputs from per-request records."""
    done = [r for r in records if r["error"] is None]
    ttft = [1e3 * (r["token_times"][0] - r["arrival_s"]) for r in done if r["token_times"]]
    tpot = [
        1e3 * (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
        for r in done
        if len(r["token_times"]) > 1
    ]
    itl = [1e3 * (b - a) for r in done for a, b in zip(r["token_times"], r["token_times"][1:])]
    start = min(r["arrival_s"] for r in records)
    end = max((r["token_times"][-1] for r in done if r["token_times"]), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(len(r["token_times"]) for r in done)
    in_tokens = sum(r["input_len"] for r in done)
    summary = {
        "num_requests": len(records),
        "num_finished": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for p, v in _percentiles(values).items():
            summary[f"{name}_{p}"] = v
    return summary


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
        from tqdm import tqdm

        progress = tqdm(total=len(requests), desc="requests", leave=False)
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
        for seq, rec in active:
            rec["token_times"] += [t] * (len(seq.output_token_ids) - len(rec["token_times"]))
            if seq.error is not None:
                rec["error"] = seq.error
            elif seq.finish_reason is None:
                still.append((seq, rec))
        if progress is not None:
            progress.update(len(active) - len(still))
        active = still
    if progress is not None:
        progress.close()
    return records


def warm_up(engine) -> None:
    """Compile every graph the run will meet (both SP and plain variants) before timing: one step
    of the largest M the scheduler can form, and a short prompt."""
    from tpweave.engine import SamplingParams

    sched = engine.scheduler
    longest = min(sched.max_num_batched_tokens, sched.max_model_len - 4)
    results = engine.generate([[1] * longest, [1] * 7], SamplingParams(max_tokens=3))
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"warm-up requests failed: {errors}")


def release_engine(engine) -> None:
    """Free an engine's KV cache, CUDA graphs and compiled code before the next arm builds its own
    (the caller must drop its reference too)."""
    engine.release()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
