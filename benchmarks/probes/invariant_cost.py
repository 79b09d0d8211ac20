"""What invariant mode costs: `tpweave bench engine` results of one session, the default mode and --invariant batch
run one after the other, their engine steps compared per row: decode steps at each batch (step_ms), the prefill's
single call, back-to-back forward and whole request, the mixed step's single call.

The runs are separate processes, so their samples are not paired: each ratio's 95% interval comes from resampling
each arm's samples on their own. Run each mode more than once, alternating (A B A, or A B A B): each arm's runs are
pooled (a drift of the GPU over the session cancels to first order), and the last default run against the first is
the A/A control. An A/A interval that excludes 1 says the session drifted by more than the intervals allow: its
costs are then not to be trusted.

    python benchmarks/probes/invariant_cost.py --default D1.json [D2.json ...] --invariant I1.json [I2.json ...]
        [--labels REFERENCE ARM] [--out cost.json]

At TP >= 2 (benchmarks/tp2_session.sh invariant8b) the reference is invariant plain TP (`--baseline --invariant
batch`) and the arm invariant SP + async TP + token split: --labels names them in the output (the JSON keeps its
field names, "default_ms" the reference's).
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


def compare(defaults: list[dict], invariants: list[dict]) -> list[dict]:
    """One row per (step, field) that every run measured: the invariant runs' pooled samples against the default
    runs' pooled samples, and with two default runs or more, the A/A ratio (last default run over the first) and its
    interval."""
    rows = []
    for row in invariants[0]["rows"]:
        what = row["what"]
        key = KEYS.get(what)
        if key is None:
            continue
        for field in FIELDS[what]:
            arms = [[_samples(r, what, key, row[key], field) for r in runs] for runs in (defaults, invariants)]
            if not all(s for runs in arms for s in runs):
                continue
            base, inv = ([x for s in runs for x in s] for runs in arms)
            ratio, lo, hi = unpaired_ratio(inv, base)
            out = {"what": what, key: row[key], "field": field, "default_ms": float(np.median(base)),
                   "invariant_ms": float(np.median(inv)), "cost": ratio, "lo": lo, "hi": hi,
                   "runs": [len(defaults), len(invariants)]}  # fmt: skip
            if len(defaults) > 1:
                aa, aa_lo, aa_hi = unpaired_ratio(arms[0][-1], arms[0][0])
                out |= {"a_a": aa, "a_a_lo": aa_lo, "a_a_hi": aa_hi, "a_a_holds": bool(aa_lo <= 1 <= aa_hi)}
            rows.append(out)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--default", nargs="+", required=True, help="the default mode's runs, in the order they ran")
    p.add_argument("--invariant", nargs="+", required=True, help="--invariant batch runs")
    p.add_argument("--labels", nargs=2, default=["default", "invariant"], metavar=("REFERENCE", "ARM"),
                   help="what the --default and --invariant runs are, for the output")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load = lambda files: [json.load(open(f)) for f in files]  # noqa: E731
    rows = compare(load(args.default), load(args.invariant))
    if not rows:
        raise SystemExit("no step measured by every run: nothing to compare")
    ref, arm = args.labels
    for r in rows:
        key = KEYS[r["what"]]
        aa = f"  A/A {r['a_a']:.3f} [{r['a_a_lo']:.3f}, {r['a_a_hi']:.3f}]" if "a_a" in r else "  A/A n/a"
        print(
            f"{r['what']:15s} {key}={r[key]:<5} {r['field']:15s} {ref} {r['default_ms']:8.3f} ms  {arm} "
            f"{r['invariant_ms']:8.3f} ms  cost {r['cost']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}]{aa}"
        )
    if args.out:
        with open(args.out, "w") as f:
            sources = {"default": args.default, "invariant": args.invariant}
            json.dump({"sources": sources, "labels": dict(zip(("default", "invariant"), args.labels)), "rows": rows},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
