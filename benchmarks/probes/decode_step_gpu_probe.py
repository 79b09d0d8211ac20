"""What a decode step runs on the GPU beyond its graph's forward: per kernel and copy name, the time per engine step
(torch.profiler over steps of `--batch` sequences at context `--context`, async scheduling as `bench engine` runs it)
against the decode graph's replay alone, and the idle time between them: each call on its own, then calls back to
back with the longest gaps between kernels and what they sit between.

    python benchmarks/probes/decode_step_gpu_probe.py [--model llama3-8b] [--batch 256] [--out DIR]
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from whole_step_gpu_probe import kernels  # this directory's: per kernel name, time per call

from tpweave.bench.engine import _decoding, _event_ms
from tpweave.bench.stats import median
from tpweave.engine import LLMEngine, SamplingParams
from tpweave.engine.buckets import bucket_for
from tpweave.ops.argmax import argmax_rows
from tpweave.runtime.context import TPContext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = LLMEngine(TPContext.single("cuda"), args.model, max_num_seqs=args.batch, max_num_batched_tokens=2048,
                       max_model_len=args.context + 128, piecewise_graphs=False)  # fmt: skip
    rng = random.Random(0)
    params = SamplingParams(max_tokens=80)  # 4 + 4 + 12 steps profiled, then 2 x (1 + 12) timed
    for _ in range(args.batch):
        _decoding(engine, [rng.randrange(engine.vocab_size) for _ in range(args.context)], params)
    for _ in range(4):
        engine.step()
    graph = engine.runner.graphs[bucket_for(sorted(engine.runner.graphs), args.batch)]
    step, replay = kernels(engine.step, calls=4), kernels(graph.replay, calls=4)
    # as `bench engine` times them: steps back to back (async scheduling keeps one in flight), replays back to back
    stream, replays = kernels(engine.step, calls=12, sync_each=False), kernels(graph.replay, calls=12, sync_each=False)
    for name, k in (("steps back to back", stream), ("replays back to back", replays)):
        print(f"{name}: kernel_us {k['kernel_us']:.0f} gap_us {k['gap_us']:.0f} per call; gaps of 200 us or more "
              f"{k['long_gap_us']:.0f} us per call ({len(k['long_gaps'])}: {[round(g[0]) for g in k['long_gaps']]}); "
              "longest gaps under 200 us:")  # fmt: skip
        for gap in k["longest_gaps"]:
            print(f"   {gap[0]:7.1f} us  after {gap[1]}  before {gap[2]}")
    # as `bench engine` samples them, without the profiler: each step's wall time (async scheduling) against
    # event-timed replays of its graph, twice in turn
    wall, replay_ms = [], []
    for _ in range(2):
        engine.step()
        t = time.perf_counter()
        for _ in range(12):
            engine.step()
            now = time.perf_counter()
            wall.append((now - t) * 1e3)
            t = now
        torch.cuda.synchronize()
        replay_ms += _event_ms(graph.replay, reps=12, warmup=1)
    print("wall ms per step", [round(w, 3) for w in wall])
    print("replay ms", [round(r, 3) for r in replay_ms])
    print(f"median step {median(wall):.3f} ms, replay {median(replay_ms):.3f} ms")
    names = set(step["per_name"]) | set(replay["per_name"])
    s, r = step["per_name"], replay["per_name"]
    diff = sorted(((s.get(n, (0, 0))[1] - r.get(n, (0, 0))[1], n, s.get(n), r.get(n)) for n in names), reverse=True)
    print(f"kernel_us step {step['kernel_us']:.0f} replay {replay['kernel_us']:.0f}; "
          f"gap_us step {step['gap_us']:.0f} replay {replay['gap_us']:.0f}")  # fmt: skip
    for d in diff[:10] + diff[-4:]:
        print(f"{d[0]:+9.1f} us  {d[1]}  step {d[2]} replay {d[3]}")
    # greedy sampling's argmax at this vocabulary: torch's reduction against ops/argmax.py (CUDA events, 50 calls)
    record_argmax = {}
    for rows in (1, 64, args.batch):
        x = torch.randn(rows, engine.vocab_size, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        for name, fn in (("torch", lambda: torch.argmax(x, -1, out=out)), ("tpweave", lambda: argmax_rows(x, out=out))):
            record_argmax[f"{name} b{rows}"] = median(_event_ms(fn, reps=50))
    print("argmax ms", json.dumps(record_argmax))
    out = Path(args.out) / f"decode_step_gpu_probe-{args.model}-b{args.batch}.json"
    record = {"argmax_ms": record_argmax, "wall_step_ms": wall, "replay_ms": replay_ms, "step": step,
              "replay": replay, "diff_us": diff, "steps_back_to_back": stream,
              "replays_back_to_back": replays}  # fmt: skip
    out.write_text(json.dumps(record, indent=1, default=str))
    print("wrote", out)


if __name__ == "__main__":
    main()
