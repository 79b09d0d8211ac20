"""Whether the invariant matmul's weight prefetch (ops/invariant_kernels.py `matmul(..., weight=True)`: the 16-row
tiles load a weight's first K step before the PDL wait) shortens a chain of decode-size products: llama3-8b's four
products per layer, LAYERS layers of their own weights, each product reading the one before, graph-replayed, in one
run with the prefetch off, on, and off again (the A/A control), order shuffled per repetition.

    python benchmarks/probes/invariant_prefetch_probe.py [--out DIR] [--ms 1,16,32]
"""

import argparse
import json
from pathlib import Path

import torch

from tpweave.bench.stats import aa_check, median, paired_ratio
from tpweave.bench.timing import time_arms
from tpweave.ops import invariant_kernels as ik

LAYERS = 8
# (N, K) of QKV, o, gate_up and down; a product reads the first K columns of the one before
PRODUCTS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--ms", default="1,16,32")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5 for n, k in PRODUCTS]
        for _ in range(LAYERS)
    ]
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        x0 = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)

        def chain(prefetch: bool):
            def run():
                h = x0
                for layer in weights:
                    for w in layer:
                        h = ik.matmul(h[:, : w.shape[1]], w.t(), weight=prefetch)
                return h

            return run

        assert torch.equal(chain(True)(), chain(False)())
        t = time_arms({"off": chain(False), "on": chain(True), "off_again": chain(False)}, reps=30, inner=5)
        off, on, again = (t[a].samples_ms for a in ("off", "on", "off_again"))
        r = paired_ratio(off, on, groups=t["off"].groups)
        row = {"m": m, "tiling": str(ik.tiling_for(m, 4096, 4096)), "off_ms": median(off), "on_ms": median(on),
               "off_over_on": r.ratio, "lo": r.lo, "hi": r.hi, "aa": aa_check(off, again, groups=t["off"].groups),
               "samples": {"off": off, "on": on, "off_again": again}}  # fmt: skip
        rows.append(row)
        print(f"m={m:<4d} off {row['off_ms']:.4f} ms  on {row['on_ms']:.4f} ms  off/on {r.ratio:.4f} "
              f"[{r.lo:.4f}, {r.hi:.4f}]  A/A {row['aa']['ratio']:.4f} [{row['aa']['lo']:.4f}, {row['aa']['hi']:.4f}]",
              flush=True)  # fmt: skip
    out = Path(args.out) / "invariant_prefetch_probe.json"
    out.write_text(json.dumps({"layers": LAYERS, "products": PRODUCTS, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
