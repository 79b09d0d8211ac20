"""What invariant mode costs: `tpweave bench engine` results of one session, the default mode and --invariant batch
run one after the other, their engine steps compared per row: decode steps at each batch (step_ms), the prefill's
single call, back-to-back forward and whole request, the mixed step's single call.

The runs are separate processes, so their samples are not paired: each ratio's 95% interval comes from resampling
each arm's samples on their own. Run the default mode twice, before and after invariant mode (A B A): the invariant
run is compared with both default runs' samples pooled (a drift of the GPU over the session cancels to first order),
and the second default run against the first is the A/A control. An A/A interval that excludes 1 says the session
drifted by more than the intervals allow: its costs are then not to be trusted.

    python benchmarks/probes/invariant_cost.py DEFAULT.json INVARIANT.json [DEFAULT_AGAIN.json] [--out cost.json]
"""

import argparse
import json

import numpy as np

from tpweave.bench.stats import BOOTSTRAP_RESAMPLES, CONFIDENCE

FIELDS = {"engine_decode": ("step_ms",), "engine_prefill": ("single_call_ms", "forward_ms", "request_ms"),
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


def _samples(result: dict, what: str, key: str, value, field: str) -> list[float] | None:
    match = [r for r in result["rows"] if r["what"] == what and r[key] == value]
    return (match[0].get(f"{field}_samples") or None) if match else None


def compare(default: dict, invariant: dict, default_again: dict | None = None) -> list[dict]:
    """One row per (step, field) that every run measured: the invariant run's cost against the default runs' pooled
    samples, and with a second default run, the A/A ratio (second over first) and its interval."""
    rows = []
    for row in invariant["rows"]:
        what = row["what"]
        key = KEYS.get(what)
        if key is None:
            continue
        for field in FIELDS[what]:
            a = _samples(invariant, what, key, row[key], field)
            bases = [_samples(r, what, key, row[key], field) for r in (default, default_again) if r is not None]
            if not a or not all(bases):
                continue
            pooled = [x for b in bases for x in b]
            ratio, lo, hi = unpaired_ratio(a, pooled)
            out = {"what": what, key: row[key], "field": field, "default_ms": float(np.median(pooled)),
                   "invariant_ms": float(np.median(a)), "cost": ratio, "lo": lo, "hi": hi}  # fmt: skip
            if len(bases) == 2:
                aa, aa_lo, aa_hi = unpaired_ratio(bases[1], bases[0])
                out |= {"a_a": aa, "a_a_lo": aa_lo, "a_a_hi": aa_hi, "a_a_holds": bool(aa_lo <= 1 <= aa_hi)}
            rows.append(out)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("default")
    p.add_argument("invariant")
    p.add_argument("default_again", nargs="?", default=None, help="a second default run after the invariant one")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs = [json.load(open(f)) if f else None for f in (args.default, args.invariant, args.default_again)]
    rows = compare(*runs)
    if not rows:
        raise SystemExit("no step measured by every run: nothing to compare")
    for r in rows:
        key = KEYS[r["what"]]
        aa = f"  A/A {r['a_a']:.3f} [{r['a_a_lo']:.3f}, {r['a_a_hi']:.3f}]" if "a_a" in r else "  A/A n/a"
        print(
            f"{r['what']:15s} {key}={r[key]:<5} {r['field']:15s} default {r['default_ms']:8.3f} ms  invariant "
            f"{r['invariant_ms']:8.3f} ms  cost {r['cost']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}]{aa}"
        )
    if args.out:
        sources = {"default": args.default, "invariant": args.invariant, "default_again": args.default_again}
        with open(args.out, "w") as f:
            json.dump({"sources": sources, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
