"""Issue 39's comparison: a `bench serve --backend openai` result (the trace through `tpweave serve`) against a
`bench serve` result (the same trace in-process), per (workload, rate): output-token throughput through HTTP over
in-process, pooled and per round, and the median TTFT / TPOT of each. Two rounds per side give no interval worth the
name, so the round-by-round ratios are listed instead.

    python benchmarks/probes/serve_http_compare.py HTTP.json INPROCESS.json [--out compare.json]
"""

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("http")
    p.add_argument("inprocess")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    http, local = (json.load(open(f)) for f in (args.http, args.inprocess))
    rows = []
    for h in http["rows"]:
        match = [r for r in local["rows"] if (r["workload"], r["rate"]) == (h["workload"], h["rate"])]
        if len(match) != 1:
            continue
        r = match[0]
        rounds = [a / b for a, b in zip(h["output_token_throughput_rounds"], r["output_token_throughput_rounds"])]
        row = {"what": "serve_http_vs_inprocess", "workload": h["workload"], "rate": h["rate"],
               "output_throughput_ratio": h["output_token_throughput"] / r["output_token_throughput"],
               "round_ratios": rounds, "http_output_token_throughput": h["output_token_throughput"],
               "inprocess_output_token_throughput": r["output_token_throughput"],
               "ttft_ms_p50_http": h["ttft_ms_p50"], "ttft_ms_p50_inprocess": r["ttft_ms_p50"],
               "tpot_ms_p50_http": h["tpot_ms_p50"], "tpot_ms_p50_inprocess": r["tpot_ms_p50"],
               "tpot_ratio": h["tpot_ms_p50"] / r["tpot_ms_p50"]}  # fmt: skip
        rows.append(row)
        ratio = row["output_throughput_ratio"]
        print(f"{h['workload']} rate {h['rate']}: output throughput http / in-process {ratio:.3f}"
              f" (rounds {', '.join(f'{x:.3f}' for x in rounds)}), TPOT p50 {h['tpot_ms_p50']:.2f} vs "
              f"{r['tpot_ms_p50']:.2f} ms, TTFT p50 {h['ttft_ms_p50']:.0f} vs {r['ttft_ms_p50']:.0f} ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sources": {"http": args.http, "inprocess": args.inprocess}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
