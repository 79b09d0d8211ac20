"""What invariant mode costs: two `tpweave bench engine` results of one session (the default mode, then
--invariant batch), their engine steps compared per row: decode steps at each batch (step_ms), the prefill's single
call and whole request, the mixed step's single call. The two runs are sequential, not interleaved: their samples
are not paired, so each ratio's 95% interval comes from resampling each run's samples on its own.

    python benchmarks/probes/invariant_cost.py DEFAULT.json INVARIANT.json [--out cost.json]
"""

import argparse
import json

import numpy as np

from tpweave.bench.stats import BOOTSTRAP_RESAMPLES, CONFIDENCE

FIELDS = {"engine_decode": ("step_ms",), "engine_prefill": ("single_call_ms", "request_ms"),
          "engine_mixed": ("single_call_ms",)}  # fmt: skip
KEYS = {"engine_decode": "batch", "engine_prefill": "tokens", "engine_mixed": "tokens"}


def unpaired_ratio(arm: list[float], base: list[float], seed: int = 0) -> tuple[float, float, float]:
    """median(arm) / median(base) and its 95% interval (each run's samples resampled on their own)."""
    a, b = np.asarray(arm, float), np.asarray(base, float)
    rng = np.random.default_rng(seed)
    boots = np.median(a[rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))], axis=1) / np.median(
        b[rng.integers(0, len(b), (BOOTSTRAP_RESAMPLES, len(b)))], axis=1
    )
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(boots, [tail, 100 - tail])
    return float(np.median(a) / np.median(b)), float(lo), float(hi)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("default")
    p.add_argument("invariant")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base, inv = (json.load(open(f)) for f in (args.default, args.invariant))
    rows = []
    for row in inv["rows"]:
        what = row["what"]
        key = KEYS.get(what)
        if key is None:
            continue
        match = [r for r in base["rows"] if r["what"] == what and r[key] == row[key]]
        if not match:
            continue
        for field in FIELDS[what]:
            a, b = row.get(f"{field}_samples"), match[0].get(f"{field}_samples")
            if not a or not b:
                continue
            ratio, lo, hi = unpaired_ratio(a, b)
            rows.append({"what": what, key: row[key], "field": field, "default_ms": float(np.median(b)),
                         "invariant_ms": float(np.median(a)), "cost": ratio, "lo": lo, "hi": hi})  # fmt: skip
            print(
                f"{what:15s} {key}={row[key]:<5} {field:15s} default {np.median(b):8.3f} ms  invariant "
                f"{np.median(a):8.3f} ms  cost {ratio:.3f}x [{lo:.3f}, {hi:.3f}]"
            )
    if args.out:
        sources = {"default": args.default, "invariant": args.invariant}
        with open(args.out, "w") as f:
            json.dump({"sources": sources, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
