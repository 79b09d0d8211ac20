"""Where the host's time goes in a mixed step (64 decodes at context 1024 + a fresh 512-token chunk) replayed from
the engine's piecewise graphs: the host time per call (no wait for the GPU), the same for the prefill of 2048
tokens, then cProfile's top functions and torch.profiler's top CPU ops of the mixed step's calls; then the host time
with Python's garbage collector frozen and off, and per call of one layer's attention op (through the dispatcher and
its Python body directly) and of the kernels' wrappers inside it, on the arguments the step gave it.

    python benchmarks/probes/mixed_host_probe.py [--model llama3-8b] [--num-layers 4] [--out DIR]
"""

import argparse
import cProfile
import gc
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
from tpweave.ops import attention, flash_prefill, rope
from tpweave.runtime.context import TPContext


def step_args(engine, decodes: int, context: int, chunk: int):
    rng = random.Random(2)
    runner, blocks = engine.runner, engine.scheduler.blocks
    chunks = []
    for _ in range(decodes):
        seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(context)])
        blocks.grow(seq, context)
        chunks.append(ScheduledChunk(seq, context - 1, 1, samples=True))
    if chunk:  # a fresh prompt's chunk of that many tokens
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


def loop_ms(fn, n: int = 200) -> float:
    """Host time per call of n calls back to back (the GPU not waited for)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return ms


def wrapper_ms(path) -> dict[str, float]:
    """Host time per call of the attention op (dispatched, and its Python body), and of the kernel wrappers it calls,
    on the arguments of the first layer's call in `path()` (captured by patching the wrappers)."""
    calls = {}
    originals = {"rotate_qk": rope.rotate_qk, "paged_prefill": flash_prefill.paged_prefill}

    def spy(name):
        def call(*a, **k):
            calls.setdefault(name, (a, k))
            return originals[name](*a, **k)

        return call

    rope.rotate_qk, flash_prefill.paged_prefill = spy("rotate_qk"), spy("paged_prefill")
    try:
        path()
    finally:
        rope.rotate_qk, flash_prefill.paged_prefill = originals["rotate_qk"], originals["paged_prefill"]
    (q, k, cos_sin, positions), rk = calls["rotate_qk"]
    v, k_cache, v_cache, slots = rk["store"]
    (_, _, _, cu, ctx, tables, block_size, scale), _ = calls["paged_prefill"]
    args = (
        q,
        k,
        v,
        k_cache,
        v_cache,
        slots,
        cu,
        ctx,
        tables,
        block_size,
        scale,
        cos_sin,
        positions,
        torch.tensor(False),
    )
    out = {
        "op_dispatched": loop_ms(lambda: torch.ops.tpweave.paged_attention.default(*args)),
        "op_python_body": loop_ms(lambda: attention.paged_attention._init_fn(*args)),
    }
    for name, (a, kw) in calls.items():
        out[name] = loop_ms(lambda a=a, kw=kw, name=name: originals[name](*a, **kw))
    out["empty_like"] = loop_ms(lambda: torch.empty_like(q))
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
        gc.collect()
        gc.freeze()
        record["mixed gc frozen"] = {"engine_host_ms": host_ms(path, 20)}
        gc.disable()
        record["mixed gc off"] = {"engine_host_ms": host_ms(path, 20)}
        gc.enable()
        gc.unfreeze()
        record["gc"] = {"counts": gc.get_count(), "objects": len(gc.get_objects())}
        record["per call ms"] = wrapper_ms(path)
        for key in ("mixed gc frozen", "mixed gc off", "gc", "per call ms"):
            print(key, record[key], flush=True)
    print("piecewise stats", runner.pieces.stats())
    with open(f"{args.out}/mixed_host_probe.json", "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
