"""Where the GPU's time goes when the engine replays its graph of a whole mixed step, against one CUDA graph of the
plain forward of the same step (`bench engine`'s yardstick, which the whole-step graph trailed by 3.4% back to back
in run ah): back-to-back time of the engine's call (upload + replay) and of the plain graph;
then per kernel name, each graph's kernel time per call (torch.profiler) and the idle time between its kernels.

    python benchmarks/probes/whole_step_gpu_probe.py [--model llama3-8b] [--num-layers 32] [--out DIR]
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from whole_step_host_probe import chunks_of, whole_step_engine  # this directory's

from tpweave.bench.stats import median
from tpweave.bench.timing import capture, time_call


def back_to_back(fn, calls: int = 3, reps: int = 10) -> float:
    return median([time_call(lambda: [fn() for _ in range(calls)], inner=1, on_cuda=True) / calls for _ in range(reps)])


def kernels(fn, calls: int = 3, *, sync_each: bool = True) -> dict:
    """Per kernel name: calls and microseconds per call of fn; per call the sum of kernel times and of gaps (a kernel
    starting after the one before ended; gaps of 200 us or more, the host's sync between calls, counted apart as
    long_gap_us, each in long_gaps); and the 8 longest gaps under 200 us with the kernels around them.
    sync_each=False: calls back to back, as a stream of engine steps runs (their boundaries' gaps then show)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)  # fmt: skip
    per = defaultdict(lambda: [0, 0.0])
    gaps, busy, around, long_gaps = 0.0, 0.0, [], []
    for i, e in enumerate(evs):
        per[e.name[:90]][0] += 1
        per[e.name[:90]][1] += e.time_range.elapsed_us()
        busy += e.time_range.elapsed_us()
        if i and e.time_range.start > evs[i - 1].time_range.end:
            gap = e.time_range.start - evs[i - 1].time_range.end
            if gap < 200:
                gaps += gap
                around.append((gap, evs[i - 1].name[:60], e.name[:60]))
            else:
                long_gaps.append((gap, evs[i - 1].name[:60], e.name[:60]))
    return {"per_name": {k: (n / calls, us / calls) for k, (n, us) in per.items()}, "kernel_us": busy / calls,
            "gap_us": gaps / calls, "longest_gaps": sorted(around, reverse=True)[:8],
            "long_gap_us": sum(g for g, _, _ in long_gaps) / calls, "long_gaps": long_gaps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = whole_step_engine(args.model, args.num_layers)
    runner = engine.runner
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model}
    with torch.no_grad():
        chunks = chunks_of(engine, 64, 1024, 512)
        bucket, run = runner.whole_step(chunks)
        step_args = runner._inputs(chunks, pad_to=bucket)
        plain = capture(lambda: runner.forward(*step_args), None)
        times = {}
        for _ in range(2):  # alternating, twice
            times.setdefault("engine_call_ms", []).append(back_to_back(run))
            times.setdefault("plain_graph_ms", []).append(back_to_back(plain))
        record["times"] = times
        print(json.dumps(times), flush=True)
        whole_k, plain_k = kernels(run), kernels(plain)
        record["whole_step_graph"], record["plain_graph"] = whole_k, plain_k
        names = set(whole_k["per_name"]) | set(plain_k["per_name"])
        w, p = whole_k["per_name"], plain_k["per_name"]
        diff = sorted(((w.get(n, (0, 0))[1] - p.get(n, (0, 0))[1], n, w.get(n), p.get(n)) for n in names), reverse=True)
        record["diff_us"] = diff
        print(
            f"kernel_us whole {whole_k['kernel_us']:.0f} plain {plain_k['kernel_us']:.0f}; "
            f"gap_us whole {whole_k['gap_us']:.0f} plain {plain_k['gap_us']:.0f}"
        )
        for d in diff[:12] + diff[-6:]:
            print(f"{d[0]:+9.1f} us  {d[1]}  whole {d[2]} plain {d[3]}")
    out = Path(args.out) / f"whole_step_gpu_probe-{args.model}-{args.num_layers}layers.json"
    out.write_text(json.dumps(record, indent=1, default=str))
    print("wrote", out)


if __name__ == "__main__":
    main()
