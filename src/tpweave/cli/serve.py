"""`tpweave serve`: the OpenAI-compatible server (server/) on every TP rank."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys

from tpweave.cli.common import check_invariant, model_config, rank_options
from tpweave.cli.errors import EXIT_FAILED, EXIT_OK, CLIError
from tpweave.cli.ranks import launcher_in_use, run_ranks
from tpweave.models.config import DTYPES


def _check_port(host: str, port: int) -> None:
    """Refuse a port this machine cannot listen on before any rank starts (rank 0 binds it again later)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise CLIError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM; exit 0 when every rank stopped cleanly with all its KV blocks free."""
    try:
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as e:
        raise CLIError(
            f"tpweave serve needs aiohttp and prometheus-client ({e}): pip install 'tpweave[serve]'"
        ) from None
    from tpweave.server.worker import ServeOptions, serve_worker

    cfg = model_config(args, **({"num_layers": args.num_layers} if args.num_layers else {}))
    if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
        raise CLIError(
            f"--max-model-len {args.max_model_len} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    if not 0 < args.gpu_memory_utilization <= 1:
        raise CLIError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port must be in 1..65535, got {args.port}")
    check_invariant(args)
    if launcher_in_use(args.launcher) == "torchrun":
        raise CLIError("tpweave serve starts its own ranks (--launcher spawn): under torchrun nothing would stop them")
    _check_port(args.host, args.port)
    engine_kwargs = {
        "dtype": DTYPES[args.dtype],
        "block_size": args.block_size,
        "num_blocks": args.num_gpu_blocks_override,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "compile_model": not args.no_compile,
        "cuda_graphs": not args.enforce_eager,
        "baseline": args.baseline,
        "invariant": args.invariant,
    }
    if args.num_layers:
        engine_kwargs["num_layers"] = args.num_layers
    opts = ServeOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=args.api_key or os.environ.get("TPWEAVE_API_KEY") or None,
                        max_pending=args.max_pending, shutdown_grace_s=args.shutdown_timeout)  # fmt: skip
    stop = mp.get_context("spawn").Event()
    signals = {"count": 0}

    def on_signal(signum, frame):
        signals["count"] += 1
        if signals["count"] > 1:
            raise KeyboardInterrupt  # a second signal: stop now (the ranks are killed)
        print(f"tpweave: {signal.Signals(signum).name}: stopping (again to stop at once)", file=sys.stderr)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rank_opts = rank_options(args)
    try:
        ends = run_ranks(serve_worker, args.model, engine_kwargs, opts, stop, opts=rank_opts)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    leaked = [e for e in ends if e["free_blocks"] != e["num_blocks"]]
    blocks = ", ".join(f"rank {e['rank']}: {e['free_blocks']}/{e['num_blocks']}" for e in ends)
    print(f"tpweave: stopped after {ends[0]['requests']} request(s); KV blocks free at exit: {blocks}")
    if leaked:
        print("tpweave: error: KV blocks were still held at exit (a leak)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
