"""Probe (one GPU): what splitting an all-gather GEMM into per-rank row chunks costs, the price
ce_overlap pays for starting on the local rows before the peers' rows arrive.

Arms per (site, M), CUDA graphs, interleaved, medians: one GEMM over all M rows; TP chunk GEMMs one
after another (`ce_overlap`); the chunks after the first on a second stream (`ce_overlap_2s`); and
both chunked arms again while a third stream copies the peer shard's bytes (device-to-device: the HBM
traffic a copy-engine push adds; on one GPU there is no NVLink).

    PYTHONPATH=src python benchmarks/probes/split_gemm_probe.py --tp 2 --out split.json
"""

from __future__ import annotations

import argparse
import json

import torch

from tpweave.bench.timing import time_arms
from tpweave.models.config import get_preset
from tpweave.tuning.table import site_shapes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-8b,llama3-70b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev, dt, tp = torch.device("cuda"), torch.bfloat16, args.tp
    streams = [torch.cuda.Stream() for _ in range(2)]
    rows_out = []
    with torch.no_grad():
        for model in args.models.split(","):
            for site in site_shapes(get_preset(model), tp):
                if site.kind != "ag_mm" or site.n >= 32000:  # the LM head runs once per step, not per layer
                    continue
                w = (torch.randn(site.n, site.k, device=dev, dtype=dt) * site.k**-0.5).t()
                for m in [int(t) for t in args.tokens.split(",")]:
                    a = torch.randn(m, site.k, device=dev, dtype=dt)
                    out = torch.empty(m, site.n, device=dev, dtype=dt)
                    rows = -(-m // tp)
                    chunks = [(lo, min(lo + rows, m)) for lo in range(0, m, rows)]
                    src, dst = (
                        torch.randn(rows, site.k, device=dev, dtype=dt),
                        torch.empty(rows, site.k, device=dev, dtype=dt),
                    )

                    def chunked(two_streams: bool, with_copy: bool):
                        main, compute, copier = torch.cuda.current_stream(), streams[0], streams[1]
                        rest = compute if two_streams else main  # where the chunks after the first run
                        compute.wait_stream(main)
                        if with_copy:  # the peers' rows "arrive" when this copy is done
                            copier.wait_stream(main)
                            with torch.cuda.stream(copier):
                                for _ in range(tp - 1):
                                    dst.copy_(src)
                        lo, hi = chunks[0]
                        torch.mm(a[lo:hi], w, out=out[lo:hi])
                        if with_copy:
                            rest.wait_stream(copier)
                        with torch.cuda.stream(rest):
                            for lo, hi in chunks[1:]:
                                torch.mm(a[lo:hi], w, out=out[lo:hi])
                        main.wait_stream(compute)
                        if with_copy:
                            main.wait_stream(copier)

                    arms = {
                        "one_gemm": lambda: torch.mm(a, w, out=out),
                        "chunks_serial": lambda: chunked(False, False),
                        "chunks_2streams": lambda: chunked(True, False),
                        "chunks_serial+copy": lambda: chunked(False, True),
                        "chunks_2streams+copy": lambda: chunked(True, True),
                    }
                    timings = time_arms(arms, reps=11, warmup=3, inner=10)
                    base = timings["one_gemm"].median_ms
                    row = {
                        "model": model,
                        "site": site.name,
                        "tokens": m,
                        **{name: round(t.median_ms * 1e3, 1) for name, t in timings.items()},
                        **{
                            f"{name}_vs_one": round(t.median_ms / base, 3)
                            for name, t in timings.items()
                            if name != "one_gemm"
                        },
                    }
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "tp": tp,
                    "unit": "us",
                    "rows": rows_out,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
