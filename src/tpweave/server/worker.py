"""What every rank of `tpweave serve` runs: build and warm the engine, then serve until told to stop.

Rank 0 also loads the tokenizer, starts the HTTP thread (server/http.py) and watches `stop` (a multiprocessing
event the launching process sets on SIGINT / SIGTERM): it then refuses new requests, lets those in flight finish for
up to the grace period, aborts the rest and stops every rank (server/engine_loop.py). The ranks ignore SIGINT
themselves: Ctrl-C in a terminal reaches the whole process group, and only the launching process acts on it.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

from tpweave.engine import LLMEngine
from tpweave.log import progress
from tpweave.models.tokenizer import load_tokenizer
from tpweave.runtime.context import TPContext
from tpweave.server.engine_loop import EngineLoop
from tpweave.server.metrics import ServerMetrics
from tpweave.server.protocol import ServedModel


@dataclass(frozen=True)
class ServeOptions:
    """The HTTP side of `tpweave serve`."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_pending: int = 1024
    shutdown_grace_s: float = 30.0


def _eos_ids(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def serve_worker(ctx: TPContext, model: str, engine_kwargs: dict[str, Any], opts: ServeOptions, stop) -> dict:
    """Serve on this rank until `stop` is set (module doc); this rank's end state (server/engine_loop.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    progress("building the engine (model, KV cache%s)", ", compile" if engine_kwargs.get("compile_model") else "")
    engine = LLMEngine(ctx, model, **engine_kwargs)
    progress("warming up (every graph serving meets)")
    engine.warm_up()
    if ctx.rank != 0:
        return EngineLoop(ctx, engine).run()
    from tpweave.server.http import HttpThread, OpenAIServer

    tokenizer = load_tokenizer(model)
    served = ServedModel(opts.served_model_name or model, engine.vocab_size, engine.config.max_model_len, tokenizer,
                         _eos_ids(tokenizer))  # fmt: skip
    metrics = ServerMetrics(served.name)
    loop = EngineLoop(ctx, engine, on_step=metrics.on_step)
    server = OpenAIServer(loop, served, metrics, api_key=opts.api_key, max_pending=opts.max_pending)
    http = HttpThread(server.app, opts.host, opts.port)
    http.start()
    metrics.on_step(engine)

    def watch() -> None:
        stop.wait()
        progress("stopping: no new requests; those in flight get %.0f s to finish", opts.shutdown_grace_s)
        server.accepting = False
        loop.drain(opts.shutdown_grace_s)

    threading.Thread(target=watch, name="tpweave-stop", daemon=True).start()
    print(f"tpweave: serving {served.name!r} on http://{opts.host}:{opts.port} (TP={ctx.world_size}); Ctrl-C or "
          "SIGTERM stops", flush=True)  # fmt: skip
    try:
        return loop.run()
    finally:
        http.close()
