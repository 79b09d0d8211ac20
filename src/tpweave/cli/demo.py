"""`tpweave demo`: the tiny model on several ranks, eager and compiled (SP + async TP), checked."""

from __future__ import annotations

import argparse

import torch

from tpweave.cli.common import model_config, rank_options
from tpweave.cli.errors import EXIT_FAILED, EXIT_OK
from tpweave.cli.ranks import run_ranks
from tpweave.log import progress
from tpweave.models.config import DTYPES

# |logit| of the tiny model is O(1): float32 differs in summation order only, 16-bit types by roundings
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}


def demo_worker(ctx, model_name: str, num_tokens: int, dtype_name: str, compile_model: bool) -> dict:
    """Eager logits of a random batch of num_tokens tokens (3 sequences) and of one token; compiled too
    unless told not to: their difference, the compile report and the strategies that ran."""
    from tpweave import compiler
    from tpweave.models import build_model
    from tpweave.models.inputs import random_batch, split_tokens
    from tpweave.ops.strategies import STRATEGIES, parse_policy

    progress("building %s on %d rank(s)", model_name, ctx.world_size)
    model = build_model(model_name, tp=ctx, dtype=DTYPES[dtype_name], seed=0)
    batch = random_batch(split_tokens(num_tokens, 3), vocab_size=model.config.vocab_size, device=ctx.device)
    small = random_batch([1], vocab_size=model.config.vocab_size, device=ctx.device)
    with torch.no_grad():
        eager, eager_small = model(*batch.args()), model(*small.args())
    summary = {
        "backend": torch.distributed.get_backend(),
        "device": str(ctx.device),
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "logits_shape": tuple(eager.shape),
        "greedy_next_tokens": eager.argmax(-1)[-4:].tolist(),
    }
    if compile_model:
        compiled = compiler.compile(model, sp_min_tokens=0)
        with torch.no_grad():
            progress("compiling and running M=%d (the graph for every M >= 2)", num_tokens)
            out = compiled(*batch.args())
            progress("compiling and running M=1 (a size-1 token dim gets its own graph)")
            out_small = compiled(*small.args())
        report = compiler.report(compiled)
        probe = torch.empty(0, device=ctx.device)
        named = {
            name for opts in compiled.plan.variants.values() for p in opts.policies() for _, name in parse_policy(p)
        }
        summary |= {
            "max_abs_diff": float((out.float() - eager.float()).abs().max()),
            "max_abs_diff_m1": float((out_small.float() - eager_small.float()).abs().max()),
            "summary": report.summary(),
            "report": str(report),
            "num_compiles": report.num_compiles,
            "ran": {m: sorted(compiled.strategies_at(m)) for m in (num_tokens, 1)},
            "unavailable": sorted(n for n in named if not STRATEGIES[n].available(probe)),
        }
    return summary


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 when every rank agrees and compiled matches eager within the dtype's tolerance."""
    model_config(args)
    opts = rank_options(args)
    print(f"tpweave demo: model={args.model} tp={args.tp} tokens={args.num_tokens} dtype={args.dtype}", flush=True)
    results = run_ranks(demo_worker, args.model, args.num_tokens, args.dtype, not args.no_compile, opts=opts)
    s = results[0]
    print(f"backend={s['backend']} device={s['device']} params/rank={s['params_per_rank']:,}")
    print(f"logits {s['logits_shape']}, greedy next tokens of the last 4 rows: {s['greedy_next_tokens']}")
    equal = True
    if "summary" in s:
        print(s["report"] if args.show_report else s["summary"])
        ran = "; ".join(f"M={m}: {', '.join(names)}" for m, names in s["ran"].items())
        print(f"strategies that ran: {ran}")
        if s["unavailable"]:
            print(f"  (named by the policies but not available on {s['device']}, so sequential runs in their place: "
                  f"{', '.join(s['unavailable'])})")  # fmt: skip
        worst = max(max(r["max_abs_diff"], r["max_abs_diff_m1"]) for r in results)
        equal = worst <= TOLERANCE[args.dtype]
        verdict = "within" if equal else "NOT within"
        print(f"compiled graphs: {s['num_compiles']} (M={args.num_tokens} and M=1)")
        print(
            f"equivalence: max |compiled - eager TP| over all ranks = {worst:.3e}: {verdict} {TOLERANCE[args.dtype]:g}"
        )
    agree = all(r["greedy_next_tokens"] == s["greedy_next_tokens"] for r in results)
    print(f"all {args.tp} ranks agree on the output: {agree}")
    if not (agree and equal):
        print("tpweave demo: FAILED (see above)")
        return EXIT_FAILED
    return EXIT_OK
