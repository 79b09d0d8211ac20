"""Where the host's time goes in a mixed step (64 decodes at context 1024 + a fresh 512-token chunk) replayed from
the engine's piecewise graphs: the host time per call (no wait for the GPU), the same for the prefill of 2048
tokens, then cProfile's top functions and torch.profiler's top CPU ops of the mixed step's calls.

    python benchmarks/probes/mixed_host_probe.py [--model llama3-8b] [--num-layers 4] [--out DIR]
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import time

import torch

from tpweave.bench.engine import _padding
from tpweave.bench.stats import median
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext


def step_args(engine, decodes: int, context: int, chunk: int):
    rng = random.Random(2)
    runner, blocks = engine.runner, engine.scheduler.blocks
    chunks = []
    for _ in range(decodes):
        seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(context)])
        blocks.grow(seq, context)
        chunks.append(ScheduledChunk(seq, context - 1, 1, samples=True))
    seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(chunk)])
    blocks.grow(seq, chunk)
    chunks.append(ScheduledChunk(seq, 0, chunk, samples=True))
    return runner._inputs(chunks, pad_to=_padding(runner, decodes + chunk))


def host_ms(fn, n: int = 10) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    engine = LLMEngine(TPContext.single("cuda"), args.model, num_layers=args.num_layers, max_num_seqs=80,
                       max_num_batched_tokens=2048, max_model_len=2100)  # fmt: skip
    runner = engine.runner
    steps = {"mixed 64x1024 + 512": step_args(engine, 64, 1024, 512), "prefill 2048": step_args(engine, 0, 0, 2048)}
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "num_layers": args.num_layers}
    with torch.no_grad():
        for name, step in steps.items():

            def path(step=step):
                with runner.pieces.replaying():
                    return runner.forward(*step)

            def eager(step=step):
                return runner.forward(*step)

            for _ in range(3):
                path()
                eager()
            record[name] = {"engine_host_ms": host_ms(path), "eager_host_ms": host_ms(eager)}
            print(name, {k: round(median(v), 3) for k, v in record[name].items()}, flush=True)
        mixed = steps["mixed 64x1024 + 512"]

        def path():
            with runner.pieces.replaying():
                return runner.forward(*mixed)

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            path()
        prof.disable()
        torch.cuda.synchronize()
        for sort in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(45)
            text = s.getvalue()
            print(text)
            with open(f"{args.out}/mixed_host_cprofile_{sort}.txt", "w") as fh:
                fh.write(text)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            for _ in range(10):
                path()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        print(table)
        with open(f"{args.out}/mixed_host_torch_profile.txt", "w") as fh:
            fh.write(table)
    print("piecewise stats", runner.pieces.stats())
    with open(f"{args.out}/mixed_host_probe.json", "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
