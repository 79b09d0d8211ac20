"""`tpweave calibrate` and `tpweave bench layer | latency | serve`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tpweave.bench.provenance import GpuSampler
from tpweave.cli.common import cached_table, check_invariant, model_config, rank_options, weights_label
from tpweave.cli.errors import EXIT_FAILED, EXIT_OK, CLIError
from tpweave.cli.output import results_dir
from tpweave.cli.ranks import run_ranks
from tpweave.models.config import DTYPES


def _settings(args: argparse.Namespace):
    from tpweave.bench.layer import BenchSettings

    return BenchSettings(
        reps=args.num_iters,
        warmup=args.num_iters_warmup,
        inner=args.inner,
        verify=not getattr(args, "no_verify", False),
        captures=args.captures,
    )


def _out(args: argparse.Namespace, default_name: str) -> tuple[Path, str]:
    name = args.name or default_name
    files = [f"{name}.json", f"{name}.md"]
    return results_dir(args.output_dir, name, files=files, overwrite=args.overwrite), name


def calibrate_worker(ctx, model, dtype_name, grid, settings, num_layers):
    """Measure on every rank; rank 0 saves the table. (table JSON, path)."""
    from tpweave.bench.calibrate import calibrate
    from tpweave.tuning.table import save_table

    table = calibrate(ctx, model, dtype_name=dtype_name, grid=grid, settings=settings, num_layers=num_layers)
    path = save_table(table) if ctx.rank == 0 else None
    return table.to_json(), str(path)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure, save the strategy table to the cache and print its policies."""
    from tpweave.tuning.table import StrategyTable

    model_config(args)
    opts = rank_options(args)
    worker_args = (args.model, args.dtype, args.num_tokens, _settings(args), args.num_layers)
    table_json, path = run_ranks(calibrate_worker, *worker_args, opts=opts)[0]
    table = StrategyTable.from_json(table_json)
    print(f"calibration table written to {path}")
    for site, policy in sorted(table.policies.items()):
        print(f"  {site:<24} {policy}")
    print(f"  sequence-parallel graph from M >= {table.sp_min_tokens}")
    return EXIT_OK


def bench_layer_worker(ctx, model, dtype_name, tokens, settings, num_layers, with_ops):
    """(layer rows [+ op rows], the record of bench_layers, the calibration table's JSON or None)."""
    from tpweave.bench.layer import bench_layers, bench_ops

    table = cached_table(model, ctx.world_size, dtype_name)
    rows, record = bench_layers(
        ctx, model, tokens, dtype_name=dtype_name, num_layers=num_layers, settings=settings, table=table
    )
    if with_ops:
        rows += bench_ops(ctx, model, tokens, dtype_name=dtype_name, settings=settings)
    return rows, record, table.to_json() if table is not None else None


def _finish(args, out: Path, name: str, meta: dict, rows: list, record: dict, table_json: str | None) -> int:
    """Write the results with the record's provenance; print the failures; the exit status: 1 when a
    kernel proof failed or an arm fell back (pass or Inductor failure, graph breaks, recompile limit)."""
    from tpweave.bench.provenance import content_hash
    from tpweave.bench.results import write_results

    table = None
    if table_json is not None:
        table_file = out / f"{name}.table.json"
        table_file.write_text(table_json)
        table = {"sha256": content_hash(table_json), "file": table_file.name}
    aa = [f"{r['tokens']}: {r['aa']['ratio']:.3f} [{r['aa']['lo']:.3f}, {r['aa']['hi']:.3f}]"
          for r in rows if r.get("aa") and r["aa"]["flagged"]]  # fmt: skip
    problems, fell_back = record["problems"], record["fallbacks"]
    failures = "; ".join([*(f"kernel proof: {p}" for p in problems), *(f"fallback: {f}" for f in fell_back)]) or None
    meta |= {
        "calibrated": table is not None, "table": table, "orders": record["orders"], "kernels": record["kernels"],
        "verification_problems": problems, "fallbacks": fell_back, "compile_reports": record["compile_reports"],
        "aa": f"interval excludes 1.0 (FLAGGED) at M = {', '.join(aa)}" if aa else "every interval holds 1.0",
        "failures": failures,
    }  # fmt: skip
    json_path, md_path = write_results(out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    if aa:
        print(
            f"A/A control FLAGGED (auto vs its own copy differs) at M = {', '.join(aa)}: "
            "the run's noise is larger than the gains it can resolve"
        )
    if failures:
        print(f"FAILED: {failures}")
        return EXIT_FAILED
    return EXIT_OK


def cmd_bench_layer(args: argparse.Namespace) -> int:
    """Time layers (and ops unless --no-ops) per arm, print the layer table, write the results."""
    from tpweave.bench.provenance import gpu_state
    from tpweave.bench.results import LAYER_COLUMNS, markdown_table, run_metadata

    model_config(args)
    opts = rank_options(args)
    out, name = _out(args, f"layer-{Path(args.model).name}-tp{args.tp}-{args.dtype}")
    worker_args = (args.model, args.dtype, args.num_tokens, _settings(args), args.num_layers, not args.no_ops)
    gpus_start = gpu_state()
    with GpuSampler(out / f"{name}-nvidia-smi.csv") as sampler:
        rows, record, table_json = run_ranks(bench_layer_worker, *worker_args, opts=opts)[0]
    meta = run_metadata(
        {"kind": "layer", "model": args.model, "tp": args.tp, "dtype": args.dtype, "layers_timed": args.num_layers,
         "reps": args.num_iters, "inner": args.inner, "weights": weights_label(args.model)},
        gpus_start=gpus_start, gpu_samples=sampler.summary(),
    )  # fmt: skip
    print(markdown_table([r for r in rows if r["what"] == "layer"], LAYER_COLUMNS))
    return _finish(args, out, name, meta, rows, record, table_json)


def bench_latency_worker(ctx, model, dtype_name, num_layers, prefill, decode, settings):
    """(rows, the record of bench_latency, the calibration table's JSON or None)."""
    from tpweave.bench.latency import bench_latency

    table = cached_table(model, ctx.world_size, dtype_name)
    rows, record = bench_latency(
        ctx, model, dtype_name=dtype_name, num_layers=num_layers, prefill=prefill, decode=decode,
        settings=settings, table=table,
    )  # fmt: skip
    return rows, record, table.to_json() if table is not None else None


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """Time prefill and decode of the whole model per arm and write the results; exit status 1 when a
    kernel proof failed or an arm fell back."""
    from tpweave.bench.provenance import gpu_state
    from tpweave.bench.results import DECODE_COLUMNS, PREFILL_COLUMNS, markdown_table, run_metadata
    from tpweave.cli.parser import LATENCY_DECODE, LATENCY_PREFILL, shape_pairs

    cfg = model_config(args)
    positions = cfg.max_position_embeddings
    too_long = [f"{b}x{n}" for b, n in (args.prefill or []) + (args.decode or []) if n > positions]
    if too_long:
        raise CLIError(f"--prefill/--decode lengths {', '.join(too_long)} exceed the model's {positions} positions")
    for flag, default in (("prefill", LATENCY_PREFILL), ("decode", LATENCY_DECODE)):
        if getattr(args, flag) is None:
            shapes = shape_pairs(default)
            setattr(args, flag, [(b, n) for b, n in shapes if n <= positions])
            left_out = [f"{b}x{n}" for b, n in shapes if n > positions]
            if left_out:
                note = f"left out {', '.join(left_out)} (the model has {positions} positions)"
                print(f"tpweave: --{flag} default: {note}", file=sys.stderr)
            if not getattr(args, flag):
                raise CLIError(f"--{flag}: no default shape fits the model's {positions} positions; give --{flag}")
    opts = rank_options(args)
    out, name = _out(args, f"latency-{Path(args.model).name}-tp{args.tp}-{args.dtype}")
    worker_args = (args.model, args.dtype, args.num_layers, args.prefill, args.decode, _settings(args))
    gpus_start = gpu_state()
    with GpuSampler(out / f"{name}-nvidia-smi.csv") as sampler:
        rows, record, table_json = run_ranks(bench_latency_worker, *worker_args, opts=opts)[0]
    meta = run_metadata(
        {"kind": "latency", "model": args.model, "tp": args.tp, "dtype": args.dtype,
         "layers": args.num_layers or cfg.num_layers, "reps": args.num_iters, "inner": args.inner,
         "weights": weights_label(args.model)},
        gpus_start=gpus_start, gpu_samples=sampler.summary(),
    )  # fmt: skip
    print(markdown_table([r for r in rows if r["what"] == "prefill"], PREFILL_COLUMNS))
    print(markdown_table([r for r in rows if r["what"] == "decode"], DECODE_COLUMNS))
    return _finish(args, out, name, meta, rows, record, table_json)


def bench_serve_worker(ctx, model, dtype_name, arms, cells, engine_kwargs, seed, rounds):
    """Every arm's engine built side by side (GPU memory split between them), then `rounds` rounds in
    each of which every (workload, rate) cell runs on every arm, the arms in an order shuffled per cell
    and round (seeded). (rows per (cell, arm), the orders, compile fallbacks, each arm's engine_stats)."""
    import random
    import time

    import torch

    from tpweave.bench.serve import SERVE_ARMS, engine_stats, release_engine, run_requests, serve_rows
    from tpweave.bench.timing import many_compiles
    from tpweave.engine import LLMEngine

    engines, build_s, steps_before = {}, {}, {}
    for i, arm in enumerate(arms):
        with many_compiles():  # each engine's KV cache from its share of what the previous ones left
            share = {"gpu_memory_utilization": 0.9 * (i + 1) / len(arms)}
            start = time.perf_counter()
            engines[arm] = LLMEngine(ctx, model, dtype=DTYPES[dtype_name], seed=0, **share,
                                     **{**engine_kwargs, **SERVE_ARMS[arm]})  # fmt: skip
            engines[arm].warm_up()
            build_s[arm] = time.perf_counter() - start
            steps_before[arm] = dict(engines[arm].runner.step_stats)
    cuda = ctx.device.type == "cuda"
    peak = dict.fromkeys(arms, 0 if cuda else None)
    rng = random.Random(seed)
    records, orders = {}, []
    for rnd in range(rounds):
        for workload, rate, requests in cells:
            order = arms[:]
            rng.shuffle(order)
            orders.append([f"{workload}/{rate}", *order])
            for arm in order:
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                    held = torch.cuda.memory_allocated(ctx.device)
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                with many_compiles():
                    records[(arm, workload, rate, rnd)] = run_requests(ctx, engines[arm], requests, seed=seed + rnd)
                if cuda:
                    peak[arm] = max(peak[arm], torch.cuda.max_memory_allocated(ctx.device) - held)
    fell_back, stats = [], {}
    for arm, engine in engines.items():
        report = getattr(engine.runner.forward, "compile_report", None)  # None: the model runs uncompiled (TP=1)
        fell_back += [f"{arm}: {note}" for note in (report.fallbacks() if report is not None else [])]
        stats[arm] = engine_stats(engine, build_s=build_s[arm], steps_before=steps_before[arm],
                                  peak_step_bytes=peak[arm])  # fmt: skip
    for engine in engines.values():
        release_engine(engine)
    rows = serve_rows(records, {(w, r): len(reqs) for w, r, reqs in cells}, arms=arms, rounds=rounds)
    return rows, orders, fell_back, stats


def _workloads(args: argparse.Namespace) -> list:
    from tpweave.bench.serve import WORKLOADS, load_requests, poisson_requests

    workloads = []
    for rate in args.request_rate:
        if args.dataset_path:
            try:
                requests = load_requests(args.dataset_path, rate=rate, seed=args.seed)
            except ValueError as e:
                raise CLIError(f"--dataset-path {args.dataset_path}: {e}") from None
            workloads.append((Path(args.dataset_path).name, rate, requests))
            continue
        for name in (w.strip() for w in args.workload.split(",") if w.strip()):
            if name not in WORKLOADS:
                raise CLIError(
                    f"--workload {name!r}: choose from {', '.join(sorted(WORKLOADS))}, or give --dataset-path"
                )
            requests = poisson_requests(num_requests=args.num_prompts, rate=rate, lengths=WORKLOADS[name],
                                        seed=args.seed, max_total=args.max_model_len)  # fmt: skip
            workloads.append((name, rate, requests))
    return workloads


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Serve the workloads through each arm's engine over interleaved rounds; exit status 1 when a cell
    lost a request or when every request of a cell failed."""
    from tpweave.bench.provenance import gpu_state
    from tpweave.bench.results import run_metadata
    from tpweave.bench.serve import SERVE_ARMS

    if args.backend == "openai":
        return _bench_serve_http(args)
    if args.base_url is not None:
        raise CLIError("--base-url goes with --backend openai")
    cfg = model_config(args, **({"num_layers": args.num_layers} if args.num_layers else {}))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in SERVE_ARMS for a in arms) or len(set(arms)) != len(arms):
        raise CLIError(f"--arms takes some of {', '.join(SERVE_ARMS)}, each once, got {args.arms!r}")
    cells = _workloads(args)
    opts = rank_options(args)
    out, name = _out(args, f"serve-{Path(args.model).name}-tp{args.tp}-{args.dtype}")
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "max_model_len": args.max_model_len, "block_size": args.block_size}  # fmt: skip
    if args.num_layers:
        engine_kwargs["num_layers"] = args.num_layers
    gpus_start = gpu_state()
    worker_args = (args.model, args.dtype, arms, cells, engine_kwargs, args.seed, args.rounds)
    with GpuSampler(out / f"{name}-nvidia-smi.csv") as sampler:
        rows, orders, fell_back, engines = run_ranks(bench_serve_worker, *worker_args, opts=opts)[0]
    failures = "; ".join(filter(None, [_serve_failures(rows), *(f"fallback: {f}" for f in fell_back)])) or None
    meta = run_metadata(
        {"kind": "serve", "model": args.model, "tp": args.tp, "dtype": args.dtype, "layers": cfg.num_layers,
         "num_requests": args.num_prompts, "rounds": args.rounds, "orders": orders, "failures": failures,
         "fallbacks": fell_back, "engines": engines,
         **engine_kwargs},
        gpus_start=gpus_start, gpu_samples=sampler.summary(),
    )  # fmt: skip
    return _finish_serve(out, name, meta, rows, failures, broken=bool(fell_back))


def _bench_serve_http(args: argparse.Namespace) -> int:
    """The workloads sent over HTTP to the server at --base-url, round after round (bench/http_client.py); the
    same rows, files and exit status as the in-process client, with one arm: "openai"."""
    from tpweave.bench.http_client import run_http_requests, served_model
    from tpweave.bench.provenance import gpu_state
    from tpweave.bench.results import run_metadata
    from tpweave.bench.serve import serve_rows

    if not args.base_url:
        raise CLIError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
    try:
        card = served_model(args.base_url, args.api_key)
    except ValueError as e:
        raise CLIError(str(e)) from None
    model = args.served_model_name or card["id"]
    vocab = card.get("vocab_size") or model_config(args).vocab_size  # other servers: --model's vocabulary
    cells = _workloads(args)
    out, name = _out(args, f"serve-http-{Path(str(model)).name}")
    records, sent = {}, {}
    gpus_start = gpu_state()
    with GpuSampler(out / f"{name}-nvidia-smi.csv") as sampler:
        for rnd in range(args.rounds):
            for workload, rate, requests in cells:
                sent[(workload, rate)] = len(requests)
                records[("openai", workload, rate, rnd)] = run_http_requests(
                    args.base_url, model, requests, vocab_size=vocab, seed=args.seed + rnd, api_key=args.api_key,
                    max_concurrency=args.max_concurrency,
                )  # fmt: skip
    rows = serve_rows(records, sent, arms=["openai"], rounds=args.rounds)
    failures = _serve_failures(rows)
    meta = run_metadata(
        {"kind": "serve", "backend": "openai", "base_url": args.base_url, "served_model": model, "vocab_size": vocab,
         "num_requests": args.num_prompts, "rounds": args.rounds, "max_concurrency": args.max_concurrency,
         "failures": failures},
        gpus_start=gpus_start, gpu_samples=sampler.summary(),
    )  # fmt: skip
    return _finish_serve(out, name, meta, rows, failures)


def _finish_serve(out: Path, name: str, meta: dict, rows: list[dict], failures: str | None, *, broken: bool = False):
    """Print and write a serving run's rows; its exit status: 1 when `broken` or a cell lost a request or finished
    none."""
    from tpweave.bench.results import SERVE_COLUMNS, markdown_table, write_results

    print(markdown_table(rows, SERVE_COLUMNS))
    json_path, md_path = write_results(out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    if failures:
        print(f"FAILED: {failures}")
    broken = broken or any(r["num_lost"] or not r["num_finished"] for r in rows)
    return EXIT_FAILED if broken else EXIT_OK


def _serve_failures(rows: list[dict]) -> str | None:
    """One line of the failed and lost requests per cell, None when every request finished."""
    parts = []
    for r in rows:
        lost = r["num_lost"]
        if r["num_failed"] or lost:
            cell = f"{r['arm']}/{r['workload']}/rate {r['rate']}"
            what = f"{r['num_failed']} of {r['num_requests']} requests failed" + (f", {lost} lost" if lost else "")
            errors = f" ({'; '.join(r['errors'][:2])})" if r.get("errors") else ""
            parts.append(f"{cell}: {what}{errors}")
    return " | ".join(parts) or None


def bench_engine_worker(ctx, model, dtype_name, num_layers, settings, engine_kwargs):
    """(rows, record) of bench/engine.py's bench_engine on this rank."""
    from tpweave.bench.engine import bench_engine

    return bench_engine(
        ctx, model, dtype_name=dtype_name, num_layers=num_layers, settings=settings, engine_kwargs=engine_kwargs
    )


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """Time the engine's decode steps against the graph-replayed forward and the HBM roofline, and prefill
    against the matmul roofline; write the results. Exit status 1 when the model's compilation fell back."""
    import torch

    from tpweave.bench.engine import EngineBenchSettings
    from tpweave.bench.provenance import gpu_state
    from tpweave.bench.results import (
        ENGINE_DECODE_COLUMNS,
        ENGINE_MIXED_COLUMNS,
        ENGINE_PREFILL_COLUMNS,
        markdown_table,
        run_metadata,
        write_results,
    )

    cfg = model_config(args, **({"num_layers": args.num_layers} if args.num_layers else {}))
    longest = max(args.context + 64, max(args.prefill) + 8)
    if longest > cfg.max_position_embeddings:
        raise CLIError(
            f"--context {args.context} / --prefill {max(args.prefill)} need {longest} positions; the model has "
            f"{cfg.max_position_embeddings}"
        )
    if args.context <= args.num_iters + args.num_iters_warmup + 2:
        raise CLIError(f"--context {args.context} must exceed --num-iters + --num-iters-warmup + 2 (the steps timed)")
    if not torch.cuda.is_available():
        raise CLIError("bench engine measures against the GPU's roofline: it needs a CUDA GPU (none found)")
    check_invariant(args)
    opts = rank_options(args)
    out, name = _out(args, f"engine-{Path(args.model).name}-tp{args.tp}-{args.dtype}")
    settings = EngineBenchSettings(
        batches=tuple(args.batch_sizes), context=args.context, prefill=tuple(args.prefill), steps=args.num_iters,
        warmup_steps=args.num_iters_warmup,
    )  # fmt: skip
    engine_kwargs = {"cuda_graphs": not args.enforce_eager, "compile_model": not args.no_compile,
                     "async_scheduling": not args.sync_scheduling, "invariant": args.invariant,
                     "baseline": args.baseline}  # fmt: skip
    gpus_start = gpu_state()
    worker_args = (args.model, args.dtype, args.num_layers, settings, engine_kwargs)
    with GpuSampler(out / f"{name}-nvidia-smi.csv") as sampler:
        rows, record = run_ranks(bench_engine_worker, *worker_args, opts=opts)[0]
    failures = "; ".join(f"fallback: {f}" for f in record["fallbacks"]) or None
    meta = run_metadata(
        {"kind": "engine", "model": args.model, "tp": args.tp, "dtype": args.dtype, "layers": cfg.num_layers,
         "failures": failures, **record},
        gpus_start=gpus_start, gpu_samples=sampler.summary(),
    )  # fmt: skip
    print(markdown_table([r for r in rows if r["what"] == "engine_decode"], ENGINE_DECODE_COLUMNS))
    print(markdown_table([r for r in rows if r["what"] == "engine_prefill"], ENGINE_PREFILL_COLUMNS))
    print(markdown_table([r for r in rows if r["what"] == "engine_mixed"], ENGINE_MIXED_COLUMNS))
    json_path, md_path = write_results(out, name, meta, rows)
    print(f"wrote {json_path} and {md_path}")
    if failures:
        print(f"FAILED: {failures}")
        return EXIT_FAILED
    return EXIT_OK
