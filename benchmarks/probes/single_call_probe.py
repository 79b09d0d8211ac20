"""Where a single engine step loses time against its forward replayed as one CUDA graph (issue 36: the mixed step of
64 decodes at context 1024 + a fresh 512-token chunk, and the prefill of 2048 tokens): per step, from an idle GPU,
the host's time from the call to its first piece's replay (Dynamo's guards, the wrappers), the GPU's time from the
call to its first kernel, its idle gaps between kernels grouped by the kernels around them, and the single call's
time with Dynamo's guard evaluation skipped (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`) against
without, interleaved. Writes single_call_probe.json and a gzipped chrome trace of the profiled calls.

    python benchmarks/probes/single_call_probe.py [--model llama3-8b] [--num-layers 32] [--out DIR]
"""

import argparse
import gzip
import json
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from mixed_host_probe import step_args  # this folder: a step's forward arguments as the engine pads them

from tpweave.bench.stats import median
from tpweave.compiler import piecewise
from tpweave.engine import LLMEngine
from tpweave.runtime.context import TPContext

STEPS = {"mixed 64x1024 + 512": (64, 1024, 512), "prefill 2048": (0, 0, 2048)}


def first_piece_ms(path, reps: int = 20) -> list[float]:
    """Host ms from the call to the first piece's __call__ (the GPU idle before it)."""
    original, seen = piecewise._Piece.__call__, []

    def spy(self, args):
        if not seen:
            seen.append(time.perf_counter())
        return original(self, args)

    out = []
    piecewise._Piece.__call__ = spy
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            seen.clear()
            t = time.perf_counter()
            path()
            out.append((seen[0] - t) * 1e3)
    finally:
        piecewise._Piece.__call__ = original
    torch.cuda.synchronize()
    return out


def single_ms(path) -> float:
    torch.cuda.synchronize()
    time.sleep(0.002)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    path()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def gaps(trace: dict, label: str) -> list[dict]:
    """Per profiled call named `label...`: call start to first kernel, kernel time, and idle gaps by the kernels
    around them."""
    events = trace["traceEvents"]
    marks = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    ranges = [e for e in marks if str(e.get("name", "")).startswith(label)]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    out = []
    for r in ranges:
        t0, t1 = r["ts"], r["ts"] + r["dur"]
        ks = [k for k in kernels if t0 <= k["ts"]]
        # the call's kernels: those launched during the range run until the GPU idles for good; take the ones
        # that start before the next range's start
        nxt = min((q["ts"] for q in marks if q["ts"] > t0), default=float("inf"))
        ks = [k for k in ks if k["ts"] < nxt]
        if not ks:
            continue
        idle = Counter()
        for a, b in zip(ks, ks[1:]):
            g = b["ts"] - (a["ts"] + a["dur"])
            if g > 0:
                idle[f"{a['name'][:40]} -> {b['name'][:40]}"] += g
        out.append({"call": r["name"], "host_us": r["dur"], "to_first_kernel_us": ks[0]["ts"] - t0,
                    "gpu_span_us": ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"], "kernel_us": sum(k["dur"] for k in ks),
                    "kernels": len(ks), "idle_us": sum(idle.values()), "idle_top": idle.most_common(8),
                    "range_end_to_last_kernel_end_us": ks[-1]["ts"] + ks[-1]["dur"] - t1})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--out", default=".")
    parser.add_argument("--no-size-asserts", action="store_true", help="Inductor's size_asserts off (its wrappers' "
                        "checks of every input's sizes and strides)")  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    if args.no_size_asserts:
        torch._inductor.config.size_asserts = False
    engine = LLMEngine(TPContext.single("cuda"), args.model, num_layers=args.num_layers, max_num_seqs=80,
                       max_num_batched_tokens=2048, max_model_len=2100)  # fmt: skip
    runner = engine.runner
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "num_layers": args.num_layers,
              "size_asserts": torch._inductor.config.size_asserts}  # fmt: skip
    with torch.no_grad():
        for name, shape in STEPS.items():
            step = step_args(engine, *shape)

            def path(step=step):
                with runner.pieces.replaying():
                    return runner.forward(*step)

            def path_skip(step=step):
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    with runner.pieces.replaying():
                        return runner.forward(*step)

            for _ in range(3):
                path()
                path_skip()
            row = {"to_first_piece_ms": median(first_piece_ms(path)),
                   "to_first_piece_skip_guards_ms": median(first_piece_ms(path_skip))}  # fmt: skip
            plain, skip = [], []
            for _ in range(20):
                plain.append(single_ms(path))
                skip.append(single_ms(path_skip))
            row |= {"single_ms": median(plain), "single_skip_guards_ms": median(skip), "single_samples": plain,
                    "single_skip_guards_samples": skip}  # fmt: skip
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:  # fmt: skip
                for i in range(4):
                    torch.cuda.synchronize()
                    time.sleep(0.005)
                    with torch.profiler.record_function(f"single {i}"):
                        path()
                torch.cuda.synchronize()
                with torch.profiler.record_function("b2b 0"):
                    for _ in range(3):
                        path()
                torch.cuda.synchronize()
            tag = name.split()[0]
            trace_file = out / f"single_call_trace_{tag}{'_nosa' if args.no_size_asserts else ''}.json"
            prof.export_chrome_trace(str(trace_file))
            trace = json.loads(trace_file.read_text())
            row["profiled_single"] = gaps(trace, "single")
            row["profiled_b2b"] = gaps(trace, "b2b")
            with open(trace_file, "rb") as src, gzip.open(f"{trace_file}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace_file.unlink()
            record[name] = row
            brief = {k: v for k, v in row.items() if not k.endswith("samples") and not k.startswith("profiled")}
            print(name, brief, flush=True)
            for p in row["profiled_single"][1:2] + row["profiled_b2b"]:
                print("  ", json.dumps(p), flush=True)
    (out / f"single_call_probe{'_nosa' if args.no_size_asserts else ''}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
