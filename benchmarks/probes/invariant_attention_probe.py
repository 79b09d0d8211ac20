"""The batch-invariant attention kernel (ops/invariant_kernels.py) at llama3-8b's TP=1 heads (32 q, 8 kv, dim 128)
over a paged pool whose block tables are as wide as the engine's (max_model_len 8192): decode steps of B sequences at
context 1024, a prefill of 2048 tokens and a mixed step, one program per tile against one per key chunk, under
several rows per product / products per program / warps / pipeline depths; whether each plan gives the bits of one
64-row product a program (a product under 64 rows runs on mma.sync instead of wgmma), and the default plan's; and the
default mode's paged prefill kernel (ops/flash_prefill.py, no invariance: what that mode runs for steps with cached
context) as `default_mode_ms`. For fresh sequences (the prefill) also the invariant kernel over their K/V packed as
the step made them instead of read from the pool (`packed_ms`, and whether it gives the pool's bits) and the default
mode's kernel for a fresh prefill on them (`default_mode_packed_ms`); for decodes, the default mode's split-K decode
kernel (ops/paged_decode.py, what that mode runs for them) as `default_mode_decode_ms`. `--layout engine` lays the
pool out as the engine does (a large pool, each sequence's blocks consecutive) instead of the context's blocks alone
in random order; `--width` sets the block tables' width (the engine's max_model_len / 16).

    python benchmarks/probes/invariant_attention_probe.py [--out DIR] [--cases prefill,mixed] [--layout engine]
"""

import argparse
import json
from pathlib import Path

import torch
from invariant_mm_probe import time_ms  # this folder: GPU time per call, replayed from a CUDA graph

from tpweave.ops import flash_prefill, paged_decode
from tpweave.ops import invariant_kernels as ik

HEADS, KV_HEADS, DIM, BLOCK, WIDTH = 32, 8, 128, 16, 8192 // 16
ENGINE_POOL_BLOCKS = 1 << 17  # 2M slots: 8 GiB of K and V at these heads, the order of an engine's pool for 4 layers
CASES = {"decode b1": ([1], [1024]), "decode b16": ([1] * 16, [1024] * 16), "decode b64": ([1] * 64, [1024] * 64),
         "decode b256": ([1] * 256, [1024] * 256), "prefill 2048": ([2048], [2048]),
         "mixed 64x1024 + 512": ([1] * 64 + [512], [1024] * 64 + [512])}  # fmt: skip
LAUNCHES = [ik.AttentionLaunch(w, s, r, sub) for w, s, r, sub in ((4, 2, 64, 1), (8, 2, 64, 1), (8, 2, 64, 2),
                                                                 (8, 2, 128, 1), (4, 2, 16, 1), (8, 2, 16, 1),
                                                                 (4, 2, 16, 2), (4, 2, 16, 4), (8, 2, 16, 4),
                                                                 (4, 2, 32, 1), (4, 1, 16, 1), (4, 3, 16, 1),
                                                                 (2, 2, 16, 1))]  # fmt: skip


def case(q_lens, ctx_lens, gen, *, layout="scattered", width=WIDTH):
    """The pool and tables: "scattered", a pool of the context's blocks alone in random order; "engine", the
    engine's (a pool of ENGINE_POOL_BLOCKS, each sequence's blocks consecutive, allocated in order)."""
    blocks = sum(-(-c // BLOCK) for c in ctx_lens)
    pool = max(blocks, ENGINE_POOL_BLOCKS) if layout == "engine" else blocks
    k_cache = torch.randn(pool * BLOCK, KV_HEADS, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    if layout == "engine":
        perm = torch.arange(blocks, device="cuda", dtype=torch.int32)
    else:
        perm = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32, device="cuda")
    used = 0
    for b, c in enumerate(ctx_lens):
        nb = -(-c // BLOCK)
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(sum(q_lens), HEADS, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cu, dict(context_lens=ctx, block_tables=tables, block_size=BLOCK, scale=DIM**-0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--cases", default="", help="comma-separated words: the cases whose name holds one (all if none)")
    p.add_argument(
        "--layout",
        choices=("scattered", "engine"),
        default="scattered",
        help="the pool: the context's blocks alone, scattered; or the engine's (large, blocks in order)",
    )
    p.add_argument("--width", type=int, default=WIDTH, help="block-table width (max_model_len / 16)")
    args = p.parse_args()
    words = [w for w in args.cases.split(",") if w]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (q_lens, ctx_lens) in CASES.items():
        if words and not any(w in name for w in words):
            continue
        q, k, v, cu, kw = case(q_lens, ctx_lens, gen, layout=args.layout, width=args.width)
        ref = ik.attention(q, k, v, cu, **kw)
        rows64 = ik.attention(q, k, v, cu, launch=ik.AttentionLaunch(rows=64), **kw)
        row = {"case": name, "layout": args.layout, "default_ms": time_ms(lambda: ik.attention(q, k, v, cu, **kw))}
        fa = (q, k, v, cu, kw["context_lens"], kw["block_tables"], BLOCK, kw["scale"])
        row["default_mode_ms"] = time_ms(lambda: flash_prefill.paged_prefill(*fa))
        if all(n == 1 for n in q_lens):  # decodes: the default mode runs its split-K decode kernel (the KV write too)
            last = kw["context_lens"].long() - 1
            rows_b = torch.arange(len(q_lens), device="cuda")
            slots = kw["block_tables"][rows_b, last // BLOCK].long() * BLOCK + last % BLOCK
            kn, vn = k[slots].clone(), v[slots].clone()  # the values already there: the pool stays as it is
            da = (q, kn, vn, k, v, slots, kw["block_tables"], kw["context_lens"], BLOCK, kw["scale"])
            row["default_mode_decode_ms"] = time_ms(lambda: paged_decode.paged_decode(*da))
        if q_lens == ctx_lens:  # fresh sequences: their K/V packed as the step made them, not read from the pool
            pos = torch.cat([torch.arange(c, device="cuda") for c in ctx_lens])
            seq = torch.cat([torch.full((c,), b, device="cuda") for b, c in enumerate(ctx_lens)])
            slots = kw["block_tables"][seq, pos // BLOCK].long() * BLOCK + pos % BLOCK
            kp, vp = k[slots], v[slots]
            packed = ik.attention(q, kp, vp, cu, scale=kw["scale"])
            row["packed_ms"] = time_ms(lambda: ik.attention(q, kp, vp, cu, scale=kw["scale"]))
            row["packed_default_bits"] = bool(torch.equal(packed, ref))
            row["default_mode_packed_ms"] = time_ms(lambda: flash_prefill.flash_prefill(q, kp, vp, cu, kw["scale"]))
        for split in (False, True):
            for launch in LAUNCHES:
                key = (f"{'chunk' if split else 'tile'}_r{launch.rows}x{launch.subtiles}w{launch.num_warps}"
                       f"s{launch.num_stages}")  # fmt: skip
                out = ik.attention(q, k, v, cu, split=split, launch=launch, **kw)
                row[f"{key}_ms"] = time_ms(lambda: ik.attention(q, k, v, cu, split=split, launch=launch, **kw))
                row[f"{key}_same_bits"] = bool(torch.equal(out, rows64))
                row[f"{key}_default_bits"] = bool(torch.equal(out, ref))
        best = min((v, key) for key, v in row.items() if key.endswith("_ms") and not key.startswith("default_mode"))
        differ = [key[: -len("_same_bits")] for key, v in row.items() if key.endswith("_same_bits") and not v]
        same = "yes" if not differ else f"no ({', '.join(differ)})"
        print(f"{name:22s} default {row['default_ms']:.4f} best {best[0]:.4f} {best[1]} bits as the 64-row "
              f"plan: {same}  "
              + " ".join(f"{k[:-3]}={v:.4f}" for k, v in row.items() if k.endswith("_ms")), flush=True)  # fmt: skip
        rows.append(row)
        out = Path(args.out) / "invariant_attention_probe.json"  # after every case: a run cut short keeps its rows
        out.write_text(json.dumps({"kv_chunk": ik.KV_CHUNK, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
