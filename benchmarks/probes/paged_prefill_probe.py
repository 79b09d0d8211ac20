"""Attention of steps where some sequence has cached context (chunked prefill, decodes mixed with a prefill chunk):
ops/flash_prefill.py's paged kernel (keys read in place from the page pool) against the path before it (each
sequence's context gathered out of the pool, then FA2 varlen: attention._paged_prefill_cuda), llama3-8b heads (32 q,
8 kv, head dim 128, bf16, block size 16).

1. Per case: the largest difference from the gather + FA2 path, then GPU time per call (20 calls back to back, best
   of 5) of each path and launch setting, with the TFLOP/s of the products that count (each query against the keys
   it sees).
2. The fresh kernel at 2048 and 4096 tokens (the same inner loop: a regression check).
3. The engine's forward of a mixed step (64 decodes at context 1024 + a 2000-token prompt, and a 2048-token chunk
   after 2048 cached tokens) with each path.

    python benchmarks/probes/paged_prefill_probe.py [--out FILE.json] [--model llama3-8b]
"""

import argparse
import json

import torch
from flash_prefill_probe import SCALE, packed, steady_ms

from tpweave.ops import attention, flash_prefill

CASES = {
    "64 decodes @1024 + 2000-token prompt": ([1] * 64 + [2000], [1024] * 64 + [2000]),
    "64 decodes @1024 + 1984 after 2048": ([1] * 64 + [1984], [1024] * 64 + [4032]),
    "2048 after 2048": ([2048], [4096]),
    "2048 after 6144": ([2048], [8192]),
    "255 decodes @1024 + 64-token chunk": ([1] * 255 + [64], [1024] * 255 + [64]),
    "16 x 128 after 512 (prefix hits)": ([128] * 16, [640] * 16),
    "64 decodes @1024": ([1] * 64, [1024] * 64),
}
SETTINGS = (
    flash_prefill.SHORT_ROWS_TUNING,  # GQA packed
    flash_prefill.PrefillTuning(16, 64, 4, 3),
    flash_prefill.DEFAULT_TUNING,
    flash_prefill.LONG_ROWS_TUNING,
)


def paged_case(q_lens, ctx_lens, heads=32, kv_heads=8, dim=128, block_size=16):
    blocks = [-(-c // block_size) for c in ctx_lens]
    pool = torch.randperm(sum(blocks) + 8, device="cuda").to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = pool[used : used + nb]
        used += nb
    slots = (sum(blocks) + 8) * block_size
    k_cache = torch.randn(slots, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q, _, _, cu = packed(q_lens, heads, kv_heads, dim)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cu, ctx, tables, block_size


def kernel_rows() -> list[dict]:
    rows = []
    for name, (q_lens, ctx_lens) in CASES.items():
        q, k_cache, v_cache, cu, ctx, tables, bs = paged_case(q_lens, ctx_lens)
        flops = sum(4 * 32 * 128 * sum(c - n + i + 1 for i in range(n)) for n, c in zip(q_lens, ctx_lens))
        gather = lambda: attention._paged_prefill_cuda(q, k_cache, v_cache, cu, ctx, tables, bs, SCALE)  # noqa: E731
        ref = gather().float()
        paths = {"gather + fa2_varlen": gather}
        for t in SETTINGS:
            paths[f"triton {t}"] = lambda t=t: flash_prefill.paged_prefill(q, k_cache, v_cache, cu, ctx, tables, bs,
                                                                           SCALE, tuning=t)  # fmt: skip
        paths["triton launch plan"] = lambda: flash_prefill.paged_prefill(q, k_cache, v_cache, cu, ctx, tables, bs,
                                                                           SCALE)  # fmt: skip
        for path, fn in paths.items():
            diff = (fn().float() - ref).abs().max().item()
            ms = steady_ms(fn)
            rows.append(dict(case=name, path=path, ms=round(ms, 4), tflop_s=round(flops / ms / 1e9, 1),
                             max_abs_diff_vs_gather=diff))  # fmt: skip
            print(rows[-1], flush=True)
    for n in (2048, 4096):
        q, k, v, cu = packed([n])
        ms = steady_ms(lambda: flash_prefill.flash_prefill(q, k, v, cu, SCALE))
        rows.append(dict(case=f"fresh {n}", path="triton fresh default", ms=round(ms, 4),
                         tflop_s=round(4 * n * (n + 1) / 2 * 32 * 128 / ms / 1e9, 1)))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def mixed_forward_rows(model: str) -> list[dict]:
    """The engine's forward of mixed steps, with the paged kernel and with gather + FA2 (the op's choice swapped)."""
    from tpweave.bench.stats import median
    from tpweave.bench.timing import time_call
    from tpweave.engine import LLMEngine
    from tpweave.engine.scheduler import ScheduledChunk
    from tpweave.engine.sequence import Sequence
    from tpweave.runtime.context import TPContext

    engine = LLMEngine(TPContext.single("cuda"), model, max_num_seqs=128, max_num_batched_tokens=4096,
                       max_model_len=8192)  # fmt: skip
    runner, blocks = engine.runner, engine.scheduler.blocks
    steps = {
        "64 decodes @1024 + 2000-token prompt": ([1] * 64 + [2000], [1024] * 64 + [2000]),
        "2048 after 2048": ([2048], [4096]),
    }
    rows = []
    for name, (q_lens, ctx_lens) in steps.items():
        seqs, chunks = [], []
        for n, c in zip(q_lens, ctx_lens):
            seq = Sequence(list(range(1, c + 1)))
            blocks.grow(seq, c)
            seqs.append(seq)
            chunks.append(ScheduledChunk(seq, c - n, n, samples=True))
        args = runner._inputs(chunks)
        fwd = lambda: runner.forward(*args)  # noqa: E731
        for path in ("triton paged", "gather + fa2_varlen"):
            if path != "triton paged":
                flash_prefill.paged_supported = lambda q, k: False
            with torch.no_grad():
                for _ in range(3):
                    fwd()
                ms = [time_call(fwd, inner=3, on_cuda=True) for _ in range(7)]  # per call
            rows.append(dict(case=name, path=path, forward_ms=median(ms), forward_ms_samples=ms))
            print(rows[-1], flush=True)
        flash_prefill.paged_supported = PAGED_SUPPORTED
        for seq in seqs:
            blocks.free(seq)
    engine.release()
    return rows


PAGED_SUPPORTED = flash_prefill.paged_supported


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--skip-forward", action="store_true")
    args = parser.parse_args()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": kernel_rows()}
    if not args.skip_forward:
        record["mixed_forward"] = mixed_forward_rows(args.model)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
