"""`tpweave demo | ...`: the command-line entry point."""
from __future__ import annotations

import argparse
import sys

import torch

from tpweave.models.config import DTYPES


def _demo_worker(ctx, model_name: str, num_tokens: int, dtype_name: str, compile_model: bool):
    from tpweave.models import build_model
    from tpweave.models.inputs import random_batch, split_tokens

    dtype = DTYPES[dtype_name]
    model = build_model(model_name, tp=ctx, dtype=dtype, seed=0)
    batch = random_batch(split_tokens(num_tokens, 3), vocab_size=model.config.vocab_size, device=ctx.device)
    with torch.no_grad():
        eager = model(*batch.args())
    summary = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": torch.distributed.get_backend(),
        "device": str(ctx.device),
        "model": model.config.name,
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "num_tokens": num_tokens,
        "logits_shape": tuple(eager.shape),
        "greedy_next_tokens": eager.argmax(-1)[-4:].tolist(),
    }
    if compile_model:
        import tpweave.compiler as tpc

        compiled = tpc.compile(model, sp_min_tokens=0)
        with torch.no_grad():
            out = compiled(*batch.args())
            small = random_batch([1], vocab_size=model.config.vocab_size, device=ctx.device)
            out_small, eager_small = compiled(*small.args()), model(*small.args())
        summary["max_abs_diff_vs_eager"] = float((out.float() - eager.float()).abs().max())
        summary["max_abs_diff_vs_eager_m1"] = float((out_small.float() - eager_small.float()).abs().max())
        summary["report"] = str(tpc.report(compiled))
        summary["num_compiles"] = tpc.report(compiled).num_compiles
    return summary


def cmd_demo(args: argparse.Namespace) -> int:
    from tpweave.runtime import launch

    nprocs = args.tp
    print(f"tpweave demo: model={args.model} tp={nprocs} tokens={args.tokens} dtype={args.dtype}", flush=True)
    results = launch(_demo_worker, args.model, args.tokens, args.dtype, not args.no_compile, nprocs=nprocs, timeout_s=args.timeout)
    s = results[0]
    print(f"backend={s['backend']} device={s['device']} params/rank={s['params_per_rank']:,}")
    print(f"logits {s['logits_shape']}, greedy next tokens of the last 4 rows: {s['greedy_next_tokens']}")
    if "report" in s:
        print(s["report"])
        print(f"compiled graphs: {s['num_compiles']} (one per variant, serving every M)")
        worst = max(max(r["max_abs_diff_vs_eager"], r["max_abs_diff_vs_eager_m1"]) for r in results)
        print(f"equivalence: max |compiled SP+async-TP - eager TP| over all ranks = {worst:.3e} (M={args.tokens} and M=1)")
    agree = all(r["greedy_next_tokens"] == s["greedy_next_tokens"] for r in results)
    print(f"all {nprocs} ranks agree on the output: {agree}")
    return 0 if agree else 1


def _tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--tokens needs token counts >= 1, got {text!r}")
    return values


def _calibrate_worker(ctx, model, dtype_name, grid, settings, num_layers):
    from tpweave.tuning.calibrate import calibrate
    from tpweave.tuning.table import save_table

    table = calibrate(ctx, model, dtype_name=dtype_name, grid=grid, settings=settings, num_layers=num_layers)
    path = save_table(table) if ctx.rank == 0 else None
    return table.to_json(), str(path)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tpweave.bench.layer import BenchSettings
    from tpweave.models.config import get_preset
    from tpweave.runtime import launch
    from tpweave.tuning.table import StrategyTable

    get_preset(args.model).check_tp(args.tp)
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, inner=args.inner)
    table_json, path = launch(_calibrate_worker, args.model, args.dtype, args.tokens, settings, args.layers, nprocs=args.tp, timeout_s=args.timeout)[0]
    table = StrategyTable.from_json(table_json)
    print(f"calibration table written to {path}")
    for site, policy in sorted(table.policies.items()):
        print(f"  {site:<24} {policy}")
    print(f"  sequence-parallel graph from M >= {table.sp_min_tokens}")
    return 0


def _bench_layer_worker(ctx, model, dtype_name, tokens, settings, num_layers, with_ops):
    from tpweave.bench.layer import bench_layers, bench_ops
    from tpweave.models.config import get_preset
    from tpweave.tuning.table import load_table, table_key

    table = load_table(table_key(get_preset(model), tp=ctx.world_size, dtype=DTYPES[dtype_name]))
    rows = bench_layers(ctx, model, tokens, dtype_name=dtype_name, num_layers=num_layers, settings=settings, table=table)
    if with_ops:
        rows += bench_ops(ctx, model, tokens, dtype_name=dtype_name, settings=settings)
    return rows, table is not None


def cmd_bench_layer(args: argparse.Namespace) -> int:
    from tpweave.bench.layer import BenchSettings
    from tpweave.bench.results import LAYER_COLUMNS, markdown_table, run_metadata, write_results
    from tpweave.models.config import get_preset
    from tpweave.runtime import launch

    get_preset(args.model).check_tp(args.tp)
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, inner=args.inner)
    rows, calibrated = launch(_bench_layer_worker, args.model, args.dtype, args.tokens, settings, args.layers, not args.no_ops,
                              nprocs=args.tp, timeout_s=args.timeout)[0]
    meta = run_metadata({"model": args.model, "tp": args.tp, "dtype": args.dtype, "layers_timed": args.layers, "calibrated": calibrated,
                         "reps": args.reps, "inner": args.inner})
    print(markdown_table([r for r in rows if r["what"] == "layer"], LAYER_COLUMNS))
    name = args.name or f"layer-{args.model}-tp{args.tp}-{args.dtype}"
    json_path, md_path = write_results(args.out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _generate_worker(ctx, model, prompts, max_tokens, temperature, top_p, engine_kwargs):
    from tpweave.engine import LLMEngine, SamplingParams

    engine = LLMEngine(ctx, model, **engine_kwargs)
    return engine.generate(prompts, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=0))


def _tokenizer(model: str):
    from pathlib import Path

    if not Path(model).is_dir() or not any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(model)


def cmd_generate(args: argparse.Namespace) -> int:
    import random

    from tpweave.models import resolve_config
    from tpweave.runtime import launch

    cfg = resolve_config(args.model)
    cfg.check_tp(args.tp)
    tok = _tokenizer(args.model)
    if args.prompt and tok is None:
        raise ValueError("--prompt needs a model directory with a tokenizer (and transformers installed); use --prompt-ids")
    if args.prompt:
        prompts = [tok.encode(p) for p in args.prompt]
    elif args.prompt_ids:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
    else:
        rng = random.Random(0)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(4, 64))] for _ in range(args.num_prompts)]
    engine_kwargs = {"dtype": DTYPES[args.dtype], "block_size": args.block_size, "num_blocks": args.num_blocks,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "compile_model": not args.no_compile,
                     "max_num_seqs": args.max_num_seqs, "baseline": args.baseline, "cuda_graphs": not args.no_cuda_graphs}
    if args.num_layers:
        engine_kwargs["num_layers"] = args.num_layers
    results = launch(_generate_worker, args.model, prompts, args.max_tokens, args.temperature, args.top_p, engine_kwargs,
                     nprocs=args.tp, timeout_s=args.timeout)[0]
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if r["error"]:
            print(f"[{i}] rejected: {r['error']}")
        elif tok is not None:
            print(f"[{i}] {tok.decode(prompt)!r} -> {tok.decode(r['token_ids'])!r} ({r['finish_reason']})")
        else:
            print(f"[{i}] {len(prompt)} prompt tokens -> {r['token_ids']} ({r['finish_reason']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpweave", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the tiny model on several ranks (gloo on CPU, NCCL on GPUs)")
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--tokens", type=int, default=37)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    demo.add_argument("--no-compile", action="store_true", help="eager forward only")
    demo.add_argument("--timeout", type=float, default=900)
    demo.set_defaults(fn=cmd_demo)

    def timing_args(p):
        p.add_argument("--model", default="llama3-8b")
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
        p.add_argument("--layers", type=int, default=2, help="decoder layers timed together (reported per layer)")
        p.add_argument("--reps", type=int, default=10)
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--inner", type=int, default=5, help="graph replays per timed sample")
        p.add_argument("--timeout", type=float, default=3600)

    cal = sub.add_parser("calibrate", help="measure every strategy per site shape and M; write the strategy table")
    timing_args(cal)
    cal.add_argument("--tokens", type=_tokens, default="1,16,64,256,512,1024,2048,4096,8192,16384")
    cal.set_defaults(fn=cmd_calibrate)

    gen = sub.add_parser("generate", help="generate with the reference engine (preset: token ids; directory with tokenizer: text)")
    gen.add_argument("--model", default="tiny", help="preset name or HF-format directory")
    gen.add_argument("--tp", type=int, default=2)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    gen.add_argument("--prompt", action="append", help="text prompt (repeatable; needs a tokenizer in --model)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeatable)")
    gen.add_argument("--num-prompts", type=int, default=4, help="random prompts when none are given")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--max-num-seqs", type=int, default=32)
    gen.add_argument("--baseline", action="store_true", help="plain TP (NCCL all-reduce), no SP / async TP")
    gen.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA graphs")
    gen.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from free GPU memory; 256 on CPU)")
    gen.add_argument("--max-num-batched-tokens", type=int, default=512)
    gen.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    gen.add_argument("--no-compile", action="store_true")
    gen.add_argument("--timeout", type=float, default=1800)
    gen.set_defaults(fn=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_cmd", required=True)
    layer = bench_sub.add_parser("layer", help="per layer and per op: baseline, SP, SP+fused, auto, compute-only")
    timing_args(layer)
    layer.add_argument("--tokens", type=_tokens, default="1,16,128,512,1024,2048,4096,8192,16384")
    layer.add_argument("--no-ops", action="store_true", help="skip the per-op table")
    layer.add_argument("--out", default="benchmarks/results")
    layer.add_argument("--name", default=None)
    layer.set_defaults(fn=cmd_bench_layer)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"tpweave: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
