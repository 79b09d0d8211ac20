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
    """`tpweave demo`: run the model eagerly (and compiled, unless --no-compile) on --tp ranks and print what
    rank 0 saw; exit status 0 when every rank agrees and compiled matches eager within the dtype's tolerance."""
    from tpweave.runtime import launch

    nprocs = args.tp
    print(f"tpweave demo: model={args.model} tp={nprocs} tokens={args.tokens} dtype={args.dtype}", flush=True)
    results = launch(
        _demo_worker, args.model, args.tokens, args.dtype, not args.no_compile, nprocs=nprocs, timeout_s=args.timeout
    )
    s = results[0]
    print(f"backend={s['backend']} device={s['device']} params/rank={s['params_per_rank']:,}")
    print(f"logits {s['logits_shape']}, greedy next tokens of the last 4 rows: {s['greedy_next_tokens']}")
    equal = True
    if "report" in s:
        print(s["report"])
        print(
            f"compiled graphs: {s['num_compiles']} (M={args.tokens} and M=1: per variant one graph serves every M "
            ">= 2, M = 1 gets its own)"
        )
        worst = max(max(r["max_abs_diff_vs_eager"], r["max_abs_diff_vs_eager_m1"]) for r in results)
        equal = worst <= _DEMO_TOLERANCE[args.dtype]
        print(
            f"equivalence: max |compiled SP+async-TP - eager TP| over all ranks = {worst:.3e} (M={args.tokens} "
            "and M=1): " + ("within" if equal else "NOT within") + f" {_DEMO_TOLERANCE[args.dtype]:g}"
        )
    agree = all(r["greedy_next_tokens"] == s["greedy_next_tokens"] for r in results)
    print(f"all {nprocs} ranks agree on the output: {agree}")
    return 0 if agree and equal else 1


# |logit| of the tiny model is O(1): float32 differs in summation order only, 16-bit types by roundings
_DEMO_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}


def _tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--tokens needs token counts >= 1, got {text!r}")
    return values


def _calibrate_worker(ctx, model, dtype_name, grid, settings, num_layers):
    from tpweave.bench.calibrate import calibrate
    from tpweave.tuning.table import save_table

    table = calibrate(ctx, model, dtype_name=dtype_name, grid=grid, settings=settings, num_layers=num_layers)
    path = save_table(table) if ctx.rank == 0 else None
    return table.to_json(), str(path)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`tpweave calibrate`: measure on --tp ranks, save the strategy table to the cache and print its policies."""
    from tpweave.bench.layer import BenchSettings
    from tpweave.models.config import get_preset
    from tpweave.runtime import launch
    from tpweave.tuning.table import StrategyTable

    get_preset(args.model).check_tp(args.tp)
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, inner=args.inner)
    table_json, path = launch(
        _calibrate_worker,
        args.model,
        args.dtype,
        args.tokens,
        settings,
        args.layers,
        nprocs=args.tp,
        timeout_s=args.timeout,
    )[0]
    table = StrategyTable.from_json(table_json)
    print(f"calibration table written to {path}")
    for site, policy in sorted(table.policies.items()):
        print(f"  {site:<24} {policy}")
    print(f"  sequence-parallel graph from M >= {table.sp_min_tokens}")
    return 0


def _bench_layer_worker(ctx, model, dtype_name, tokens, settings, num_layers, with_ops):
    from tpweave.bench.layer import bench_layers, bench_ops

    table = _cached_table(model, ctx.world_size, dtype_name)
    rows = bench_layers(
        ctx, model, tokens, dtype_name=dtype_name, num_layers=num_layers, settings=settings, table=table
    )
    if with_ops:
        rows += bench_ops(ctx, model, tokens, dtype_name=dtype_name, settings=settings)
    return rows, table is not None


def cmd_bench_layer(args: argparse.Namespace) -> int:
    """`tpweave bench layer`: time layers (and ops unless --no-ops) per arm, print the layer table and write
    the JSON and markdown results under --out."""
    from tpweave.bench.layer import BenchSettings
    from tpweave.bench.results import LAYER_COLUMNS, markdown_table, run_metadata, write_results
    from tpweave.models.config import get_preset
    from tpweave.runtime import launch

    get_preset(args.model).check_tp(args.tp)
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, inner=args.inner)
    rows, calibrated = launch(
        _bench_layer_worker,
        args.model,
        args.dtype,
        args.tokens,
        settings,
        args.layers,
        not args.no_ops,
        nprocs=args.tp,
        timeout_s=args.timeout,
    )[0]
    meta = run_metadata(
        {
            "model": args.model,
            "tp": args.tp,
            "dtype": args.dtype,
            "layers_timed": args.layers,
            "calibrated": calibrated,
            "reps": args.reps,
            "inner": args.inner,
        }
    )
    print(markdown_table([r for r in rows if r["what"] == "layer"], LAYER_COLUMNS))
    name = args.name or f"layer-{args.model}-tp{args.tp}-{args.dtype}"
    json_path, md_path = write_results(args.out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _pairs(text: str) -> list[tuple[int, int]]:
    """'1x2048,4x512' -> [(1, 2048), (4, 512)]; 'AxB' means batch x length."""
    try:
        out = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or min(p) < 1 for p in out):
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH pairs like 1x2048,4x512, got {text!r}")
    return out


def _cached_table(model: str, tp: int, dtype_name: str):
    from tpweave.models import resolve_config
    from tpweave.tuning.table import load_table, table_key

    return load_table(table_key(resolve_config(model), tp=tp, dtype=DTYPES[dtype_name]))


def _bench_latency_worker(ctx, model, dtype_name, num_layers, prefill, decode, settings, verify):
    from tpweave.bench.latency import bench_latency

    table = _cached_table(model, ctx.world_size, dtype_name)
    rows, kernels, problems = bench_latency(
        ctx,
        model,
        dtype_name=dtype_name,
        num_layers=num_layers,
        prefill=prefill,
        decode=decode,
        settings=settings,
        table=table,
        verify=verify,
    )
    return rows, kernels, problems, table is not None


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """`tpweave bench latency`: time prefill and decode of the whole model per arm and write the results;
    exit status 3 when the kernel verification found an arm that did not run what it should."""
    from tpweave.bench.layer import BenchSettings
    from tpweave.bench.results import DECODE_COLUMNS, PREFILL_COLUMNS, markdown_table, run_metadata, write_results
    from tpweave.models import resolve_config
    from tpweave.runtime import launch

    cfg = resolve_config(args.model)
    cfg.check_tp(args.tp)
    too_long = [p for p in args.prefill + args.decode if p[1] > cfg.max_position_embeddings]
    if too_long:
        raise ValueError(f"lengths {too_long} exceed the model's {cfg.max_position_embeddings} positions")
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, inner=args.inner)
    rows, kernels, problems, calibrated = launch(
        _bench_latency_worker,
        args.model,
        args.dtype,
        args.layers,
        args.prefill,
        args.decode,
        settings,
        not args.no_verify,
        nprocs=args.tp,
        timeout_s=args.timeout,
    )[0]
    meta = run_metadata(
        {
            "kind": "latency",
            "model": args.model,
            "tp": args.tp,
            "dtype": args.dtype,
            "layers": args.layers or cfg.num_layers,
            "calibrated": calibrated,
            "reps": args.reps,
            "inner": args.inner,
            "kernels": kernels,
            "verification_problems": problems,
        }
    )
    print(markdown_table([r for r in rows if r["what"] == "prefill"], PREFILL_COLUMNS))
    print(markdown_table([r for r in rows if r["what"] == "decode"], DECODE_COLUMNS))
    name = args.name or f"latency-{args.model}-tp{args.tp}-{args.dtype}"
    json_path, md_path = write_results(args.out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    if problems:
        print("tpweave: kernel verification FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    return 0


def _bench_serve_worker(ctx, model, dtype_name, arms, workloads, engine_kwargs, seed):
    from tpweave.bench.serve import release_engine, run_requests, summarize, warm_up
    from tpweave.bench.timing import allow_many_compiles
    from tpweave.engine import LLMEngine

    allow_many_compiles()
    rows, records = [], {}
    for arm in arms:
        engine = LLMEngine(ctx, model, dtype=DTYPES[dtype_name], seed=0, baseline=arm == "baseline", **engine_kwargs)
        warm_up(engine)
        for workload, rate, requests in workloads:
            recs = run_requests(ctx, engine, requests, seed=seed)
            records[f"{arm}/{workload}/{rate}"] = recs
            rows.append(
                {
                    "what": "serve",
                    "workload": workload,
                    "rate": rate,
                    "arm": arm,
                    **summarize(recs),
                    "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
                }
            )
        release_engine(engine)
        engine = None  # noqa: F841  (drop the last reference before the next arm allocates)
    for r in rows:
        base = next(b for b in rows if b["arm"] == arms[0] and (b["workload"], b["rate"]) == (r["workload"], r["rate"]))
        r["vs_baseline"] = (
            r["output_token_throughput"] / base["output_token_throughput"] if base["output_token_throughput"] else None
        )
    return rows, records


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """`tpweave bench serve`: serve the workloads (or --requests-file) at each rate through the engine per arm
    and write the results; exit status 1 when a request was neither finished nor failed."""
    from pathlib import Path

    from tpweave.bench.results import SERVE_COLUMNS, markdown_table, run_metadata, write_results
    from tpweave.bench.serve import WORKLOADS, load_requests, poisson_requests
    from tpweave.models import resolve_config
    from tpweave.runtime import launch

    cfg = resolve_config(args.model)
    cfg.check_tp(args.tp)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ("baseline", "auto") for a in arms):
        raise ValueError(f"--arms takes baseline and/or auto, got {args.arms!r}")
    workloads = []
    for rate in args.rates:
        if args.requests_file:
            workloads.append(
                (Path(args.requests_file).name, rate, load_requests(args.requests_file, rate=rate, seed=args.seed))
            )
            continue
        for name in args.workload.split(","):
            if name not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r}: choose from {sorted(WORKLOADS)} or give --requests-file")
            workloads.append(
                (
                    name,
                    rate,
                    poisson_requests(
                        num_requests=args.num_requests, rate=rate, lengths=WORKLOADS[name], seed=args.seed
                    ),
                )
            )
    engine_kwargs = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
    }
    if args.layers:
        engine_kwargs["num_layers"] = args.layers
    rows, records = launch(
        _bench_serve_worker,
        args.model,
        args.dtype,
        arms,
        workloads,
        engine_kwargs,
        args.seed,
        nprocs=args.tp,
        timeout_s=args.timeout,
    )[0]
    meta = run_metadata(
        {
            "kind": "serve",
            "model": args.model,
            "tp": args.tp,
            "dtype": args.dtype,
            "layers": args.layers or cfg.num_layers,
            "num_requests": args.num_requests,
            **engine_kwargs,
        }
    )
    print(markdown_table(rows, SERVE_COLUMNS))
    name = args.name or f"serve-{args.model}-tp{args.tp}-{args.dtype}"
    json_path, md_path = write_results(args.out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    lost = [r for r in rows if r["num_finished"] + r["num_failed"] != r["num_requests"]]
    if lost:
        cells = ", ".join(f"{r['arm']}/{r['workload']}/{r['rate']}" for r in lost)
        print(f"tpweave: error: requests unaccounted for (neither finished nor failed) in {cells}", file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`tpweave report`: render results JSON files into one markdown report (--out/--name), print and write it."""
    from pathlib import Path

    from tpweave.bench.results import load_results, render

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for path in args.results:
        meta, rows = load_results(path)
        parts.append(render(Path(path).stem, meta, rows, out))
    report = "\n\n".join(parts)
    (out / args.name).write_text(report)
    print(report)
    print(f"wrote {out / args.name}")
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
    """`tpweave generate`: generate from the prompts (text, token ids, or random ids) with the engine on --tp
    ranks and print each completion, decoded when the model directory has a tokenizer."""
    import random

    from tpweave.models import resolve_config
    from tpweave.runtime import launch

    cfg = resolve_config(args.model)
    cfg.check_tp(args.tp)
    tok = _tokenizer(args.model)
    if args.prompt and tok is None:
        raise ValueError(
            "--prompt needs a model directory with a tokenizer (and transformers installed); use --prompt-ids"
        )
    if args.prompt:
        prompts = [tok.encode(p) for p in args.prompt]
    elif args.prompt_ids:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
    else:
        rng = random.Random(0)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(4, 64))] for _ in range(args.num_prompts)]
    engine_kwargs = {
        "dtype": DTYPES[args.dtype],
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "compile_model": not args.no_compile,
        "max_num_seqs": args.max_num_seqs,
        "baseline": args.baseline,
        "cuda_graphs": not args.no_cuda_graphs,
    }
    if args.num_layers:
        engine_kwargs["num_layers"] = args.num_layers
    results = launch(
        _generate_worker,
        args.model,
        prompts,
        args.max_tokens,
        args.temperature,
        args.top_p,
        engine_kwargs,
        nprocs=args.tp,
        timeout_s=args.timeout,
    )[0]
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if r["error"]:
            print(f"[{i}] rejected: {r['error']}")
        elif tok is not None:
            print(f"[{i}] {tok.decode(prompt)!r} -> {tok.decode(r['token_ids'])!r} ({r['finish_reason']})")
        else:
            print(f"[{i}] {len(prompt)} prompt tokens -> {r['token_ids']} ({r['finish_reason']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the subcommand; its exit status, 2 on a ValueError (printed)."""
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

    gen = sub.add_parser(
        "generate", help="generate with the reference engine (preset: token ids; directory with tokenizer: text)"
    )
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
    gen.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: from free GPU memory; 256 on CPU)"
    )
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

    lat = bench_sub.add_parser("latency", help="whole model: prefill TTFT and decode TPOT per arm, kernel verification")
    timing_args(lat)
    lat.set_defaults(layers=None)
    lat.add_argument(
        "--prefill",
        type=_pairs,
        default="1x128,1x512,1x1024,1x2048,1x4096,1x8192,1x16384,1x32768,4x512,4x2048,8x1024",
        help="BATCHxINPUT_LEN pairs",
    )
    lat.add_argument(
        "--decode",
        type=_pairs,
        default="1x1024,4x1024,16x1024,64x1024,128x1024,256x1024,1x4096,16x4096,64x4096",
        help="BATCHxCONTEXT pairs",
    )
    lat.add_argument("--no-verify", action="store_true", help="skip the profiler check of which kernels ran")
    lat.add_argument("--out", default="benchmarks/results")
    lat.add_argument("--name", default=None)
    lat.set_defaults(fn=cmd_bench_latency)

    serve = bench_sub.add_parser(
        "serve", help="Poisson arrivals through the engine: TTFT, TPOT, ITL, throughput per arm"
    )
    serve.add_argument("--model", default="llama3-8b")
    serve.add_argument("--tp", type=int, default=2)
    serve.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    serve.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    serve.add_argument("--arms", default="baseline,auto")
    serve.add_argument("--workload", default="prefill-heavy,decode-heavy,mixed")
    serve.add_argument("--requests-file", default=None, help="JSON/CSV with input_len, output_len[, arrival_s]")
    serve.add_argument(
        "--rates", type=lambda t: [float(v) for v in t.split(",")], default="2,8", help="requests per second"
    )
    serve.add_argument("--num-requests", type=int, default=64)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=8192)
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--timeout", type=float, default=3600)
    serve.add_argument("--out", default="benchmarks/results")
    serve.add_argument("--name", default=None)
    serve.set_defaults(fn=cmd_bench_serve)

    rep = sub.add_parser("report", help="render results JSON files as one markdown report with PNG plots")
    rep.add_argument("results", nargs="+")
    rep.add_argument("--out", default="benchmarks/results")
    rep.add_argument("--name", default="REPORT.md")
    rep.set_defaults(fn=cmd_report)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"tpweave: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
