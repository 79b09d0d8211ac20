"""Whether loading the first weight / K-V tiles before the PDL wait (ops/gemv.py GemvTuning.prefetch,
ops/paged_decode.py DecodeTuning.prefetch) speeds the engine's decode forward: the llama3-8b engine built once, its
decode CUDA graphs re-captured per setting, each setting timed as `tpweave bench engine` times it (bench/engine.py
_decode_rows), settings interleaved over two rounds. Then where the prefill forward's time goes: the kernels of one
2048-token forward on a timeline, the GPU idle time between them and the largest gaps.

    python benchmarks/probes/prefetch_probe.py [--batches 1,64] [--prefill 2048] [--out FILE.json]
"""

import argparse
import dataclasses
import json
import random

import torch

from tpweave.bench import engine as bench
from tpweave.bench.stats import median
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.ops import gemv, paged_decode
from tpweave.runtime.context import TPContext


def use(gemv_tiles: int, decode_tile: bool, tuning_for) -> None:
    def one_row(m, n, k, **kw):  # tuning_for takes no prefetch above one row (shared memory)
        t = tuning_for(m, n, k, **kw)
        return dataclasses.replace(t, prefetch=bool(gemv_tiles)) if m == 1 else t

    gemv.tuning_for = one_row
    paged_decode.DEFAULT_TUNING = dataclasses.replace(paged_decode.DecodeTuning(), prefetch=decode_tile)


def prefill_timeline(engine: LLMEngine, num_tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    rng = random.Random(1)
    seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(num_tokens)])
    engine.scheduler.blocks.grow(seq, num_tokens)
    args = runner._inputs([ScheduledChunk(seq, 0, num_tokens, samples=True)])
    with torch.no_grad():
        fwd = bench._event_ms(lambda: runner.forward(*args), reps=10)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.forward(*args)
            torch.cuda.synchronize()
    engine.scheduler.blocks.free(seq)
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    gaps, by_name, busy_end = [], {}, kernels[0][0]
    for (start, end, name), prev in zip(kernels, [None, *kernels[:-1]]):
        if prev is not None and start > busy_end:
            gaps.append((start - busy_end, prev[2][:80], name[:80]))
        busy_end = max(busy_end, end)
        by_name[name[:100]] = by_name.get(name[:100], 0.0) + (end - start) / 1e3
    gaps.sort(reverse=True)
    span_ms = (busy_end - kernels[0][0]) / 1e3
    idle_ms = sum(g[0] for g in gaps) / 1e3
    gap_kinds: dict[str, list[float]] = {}
    for us, before, after in gaps:
        gap_kinds.setdefault(f"{before} -> {after}", []).append(us)
    return dict(
        tokens=num_tokens,
        forward_ms=median(fwd),
        forward_ms_samples=fwd,
        kernels=len(kernels),
        span_ms=span_ms,
        idle_ms=idle_ms,
        kernel_ms=sum(by_name.values()),
        by_name_ms=dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
        gaps_by_neighbours_us={k: dict(n=len(v), total=sum(v), max=max(v)) for k, v in sorted(
            gap_kinds.items(), key=lambda kv: -sum(kv[1]))[:25]},
        largest_gaps_us=gaps[:20],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prefill", default="2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default="0:0,1:0,1:1", help="GEMV tile:decode tile (0/1 each), ...")
    parser.add_argument("--engine-graphs-first", action="store_true", help="first time the graphs the engine made")
    parser.add_argument("--out")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    ctx = TPContext.single("cuda")
    engine = LLMEngine(ctx, "llama3-8b", max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2056)
    hbm, _ = bench.hbm_bandwidth(ctx.device)
    settings = bench.EngineBenchSettings(batches=batches, steps=32, warmup_steps=4, replays=50)
    tuning_for, rows = gemv.tuning_for, []
    chosen = [(int(a), bool(int(b))) for a, b in (x.split(":") for x in args.settings.split(","))]
    if any(a not in (0, 1) for a, _ in chosen):  # a second GEMV tile was measured slower and removed (ops/gemv.py)
        raise ValueError(f"--settings: the GEMV prefetches 0 or 1 tile, got {args.settings}")
    for rnd in range(args.rounds):
        for setting in ([None] if args.engine_graphs_first and rnd == 0 else []) + chosen:
            if setting is None:  # the defaults, in the graphs the engine captured for all its buckets
                gemv_tiles, decode_tile = -1, None
            else:
                gemv_tiles, decode_tile = setting
                use(gemv_tiles, decode_tile, tuning_for)
                engine.runner._capture_decode_graphs(list(batches))
            for r in bench._decode_rows(ctx, engine, settings, hbm):
                row = dict(round=rnd, gemv_prefetch=gemv_tiles, decode_prefetch=decode_tile, batch=r["batch"])
                row |= {k: r[k] for k in ("step_ms", "forward_ms", "of_roofline", "forward_ms_samples")}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "forward_ms_samples"}, flush=True)
    use(1, True, tuning_for)
    timelines = []
    for n in (int(t) for t in args.prefill.split(",") if t.strip() not in ("", "0")):
        timelines.append(prefill_timeline(engine, n))
        print({k: v for k, v in timelines[-1].items() if not k.endswith("samples")}, flush=True)
    engine.release()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "decode": rows, "prefill": timelines}, f, indent=1)


if __name__ == "__main__":
    main()
