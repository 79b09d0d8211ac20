"""The host's time to build a step's inputs (no GPU needed: the model runner's numpy work, on a CPU engine of the tiny
model): a decode step's static inputs at batch 1, 64 and 256 (context 1024, blocks of 16: `_write_decode_inputs`),
and a mixed step of 64 such decodes + a fresh 512-token chunk (`_host_inputs`, padded as a graph of the whole step
pads it). Medians over --calls calls, after warm-up; with --json, the record on stdout.

    python benchmarks/probes/host_inputs_probe.py [--calls 300] [--json]
"""

import argparse
import json
import platform
import subprocess
import time

import numpy as np
import torch

from tpweave.bench.stats import median
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext

CONTEXT, BLOCK = 1024, 16


def decodes(engine, batch: int, rng) -> list[ScheduledChunk]:
    chunks = []
    for _ in range(batch):
        seq = Sequence(rng.integers(0, engine.vocab_size, CONTEXT + 1).tolist())
        engine.scheduler.blocks.grow(seq, CONTEXT + 1)
        chunks.append(ScheduledChunk(seq, CONTEXT, 1))
    return chunks


def per_call_ms(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = LLMEngine(TPContext.single("cpu"), "tiny", dtype=torch.float32, compile_model=False, block_size=BLOCK,
                       num_blocks=40000, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096)  # fmt: skip
    runner, rng = engine.runner, np.random.default_rng(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"commit": commit, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    for batch in (1, 64, 256):
        chunks = decodes(engine, batch, rng)
        host = {k: np.zeros(v[0], dtype=torch.empty(0, dtype=v[1]).numpy().dtype)
                for k, v in runner._decode_fields(batch).items()}  # fmt: skip
        record[f"decode_inputs_ms batch={batch}"] = per_call_ms(lambda: runner._write_decode_inputs(chunks, host),
                                                                args.calls)  # fmt: skip
    chunks = decodes(engine, 64, rng)
    fresh = Sequence(rng.integers(0, engine.vocab_size, 512).tolist())
    engine.scheduler.blocks.grow(fresh, 512)
    chunks.append(ScheduledChunk(fresh, 0, 512))
    record["mixed_inputs_ms 64x1024+512 padded to 640"] = per_call_ms(
        lambda: runner._host_inputs(chunks, pad_to=640, rows_to=80, seqs_to=82, width_to=256), args.calls
    )
    print(json.dumps(record) if args.json else "\n".join(f"{k}: {v}" for k, v in record.items()))


if __name__ == "__main__":
    main()
