"""The batch-invariant Triton matmul (ops/invariant_kernels.py) against cuBLAS (torch.mm) at llama3-8b's TP=1
shapes, under several launch shapes (the pointer kernel's, and the TMA candidates: ik.TMA_TILINGS), and whether every
one gives the same bits as the default choice at M = 2048 (rows 0..M-1): which shapes could be picked per M without
changing a row.

    python benchmarks/probes/invariant_mm_probe.py [--out DIR] [--ms 576,1024] [--tilings 128x64s4_tma,...]

(--ms: other row counts than MS; --tilings: only these labels, the default choice and cuBLAS always timed.)
"""

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tpweave.bench.stats import median
from tpweave.bench.timing import capture, time_call
from tpweave.ops import invariant_kernels as ik

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip
MS = (1, 16, 64, 128, 256, 512, 2048)
SMALL_ONLY = ("16x64", "16x32k128")  # mma.sync tiles: timed at decode sizes only
TILINGS = {
    "64x64": ik.SMALL_M_TILING,
    "64x32k128": ik.SMALL_M_LONG_K_TILING,
    "128x64": ik.MID_M_TILING,
    "64x128": ik.WIDE_SMALL_M_TILING,
    "128x128": ik.LARGE_M_TILING,
    "128x256": ik.LARGE_M_WIDE_TILING,
    "16x64": replace(ik.SMALL_M_TILING, block_m=16),
    "16x32k128": replace(ik.SMALL_M_LONG_K_TILING, block_m=16),
}
# narrower and deeper 16-row tiles: more programs, more bytes in flight per program, for one-row products
# (label, columns, K step, stages, warps)
TINY_CANDIDATES = (
    ("16x16k256", 16, 256, 4, 4), ("16x16k128", 16, 128, 6, 4), ("16x32k256", 32, 256, 4, 4),
    ("16x64k128", 64, 128, 4, 4), ("16x32k128w2", 32, 128, 5, 2), ("16x32k256w2", 32, 256, 4, 2),
    ("16x16k256w2", 16, 256, 4, 2), ("16x64k128w2", 64, 128, 4, 2), ("16x64k64w2", 64, 64, 6, 2),
    ("16x32k128s8w2", 32, 128, 8, 2), ("16x16k512w2", 16, 512, 3, 2), ("16x16k512s4w2", 16, 512, 4, 2),
    ("16x16k512s2w2", 16, 512, 2, 2), ("16x16k1024s2w2", 16, 1024, 2, 2), ("16x32k512w2", 32, 512, 3, 2),
    ("16x16k512w4", 16, 512, 3, 4), ("16x16k512w1", 16, 512, 3, 1),
)  # fmt: skip
TILINGS |= {
    label: ik.MatmulTiling(block_m=16, block_n=n, block_k=k, num_stages=stages, num_warps=warps)
    for label, n, k, stages, warps in TINY_CANDIDATES
}


def _label(t: ik.MatmulTiling) -> str:
    k = "" if t.block_k == 64 else f"k{t.block_k}"
    kind = "tma_ws" if t.warp_specialize else "tma_p" if t.persistent else "tma"
    return f"{t.block_m}x{t.block_n}{k}s{t.num_stages}_{kind}"


SMALL_ONLY += tuple(label for label, t in TILINGS.items() if t.block_m == 16 and label not in SMALL_ONLY)
TILINGS |= {_label(t): t for t in ik.TMA_TILINGS}  # the same tiles with A and B through the TMA
SMALL_ONLY += tuple(_label(t) for t in ik.TMA_TILINGS if t.block_n < 32)  # many narrow tiles: for decode sizes
CALLS = 10  # graph replays back to back between the events


def time_ms(fn, reps=20) -> float:
    """GPU milliseconds per call, the call replayed from a CUDA graph (no launch overhead on the host, as in the
    engine's graphs)."""
    replay = capture(fn, None)
    for _ in range(3):
        replay()
    return median([time_call(replay, inner=CALLS, on_cuda=True) for _ in range(reps)])


def _time_tilings(row: dict, x, w, ref, tilings: dict) -> None:
    m = row["m"]
    for label, tiling in tilings.items():
        if label in SMALL_ONLY and m > 64:
            continue
        out = ik.matmul(x[:m], w.t(), tiling=tiling)
        row[f"{label}_ms"] = time_ms(lambda: ik.matmul(x[:m], w.t(), tiling=tiling))
        row[f"{label}_same_bits"] = bool(torch.equal(out, ref[:m]))


def _summary(row: dict) -> str:
    best = min((v, key) for key, v in row.items() if key.endswith("_ms") and key not in ("cublas_ms",))
    row["best"] = best[1]
    differ = [key[: -len("_same_bits")] for key, v in row.items() if key.endswith("_same_bits") and not v]
    tma = min(((v, key) for key, v in row.items() if "_tma" in key and key.endswith("_ms")), default=(0.0, "none"))
    return (f"{row['shape']:8s} m={row['m']:<5d} cublas {row['cublas_ms']:.4f} default {row['default_ms']:.4f} "
            f"({row['default_tiling']}) best {best[0]:.4f} {best[1]} best TMA {tma[0]:.4f} {tma[1]} other bits: "
            f"{differ or 'none'}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--tilings", default=",".join(TILINGS))
    args = p.parse_args()
    ms = tuple(int(m) for m in args.ms.split(","))
    unknown = sorted(set(args.tilings.split(",")) - set(TILINGS))
    if unknown:
        raise SystemExit(f"--tilings: unknown {unknown}; labels: {', '.join(TILINGS)}")
    chosen = {k: TILINGS[k] for k in args.tilings.split(",")}
    g = torch.Generator(device="cuda").manual_seed(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "invariant_mm_probe.json"
    tilings = {k: asdict(t) for k, t in chosen.items()}
    rows, inputs = [], {}
    # the warp-specialized tilings last, in a pass of their own: a hang there (Triton's warp specialization on
    # Hopper is new) loses only them
    warp_specialized = {k: t for k, t in chosen.items() if t.warp_specialize}
    for pass_tilings in ({k: t for k, t in chosen.items() if k not in warp_specialized}, warp_specialized):
        for name, (n, k) in SHAPES.items():
            if name not in inputs:
                w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
                x = torch.randn(max(ms), k, device="cuda", generator=g, dtype=torch.bfloat16)
                inputs[name] = (w, x, ik.matmul(x, w.t()))
            w, x, ref = inputs[name]
            for m in ms:
                row = next((r for r in rows if r["shape"] == name and r["m"] == m), None)
                if row is None:
                    row = {"shape": name, "n": n, "k": k, "m": m,
                           "cublas_ms": time_ms(lambda: torch.mm(x[:m], w.t())),
                           "default_tiling": next(t for t, v in TILINGS.items() if v == ik.tiling_for(m, n, k)),
                           "default_ms": time_ms(lambda: ik.matmul(x[:m], w.t())),
                           "default_same_bits": bool(torch.equal(ik.matmul(x[:m], w.t()), ref[:m]))}  # fmt: skip
                    rows.append(row)
                _time_tilings(row, x, w, ref, pass_tilings)
                print(_summary(row), flush=True)
                # after every row: a run cut short keeps its rows
                out.write_text(json.dumps({"tilings": tilings, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
