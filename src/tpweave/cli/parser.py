"""The argument parser: every option with help text, its default, units and choices; flag names as vLLM
names the same concepts (-tp/--tensor-parallel-size, --num-prompts, --request-rate, --num-iters, ...)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from tpweave.cli.errors import EXIT_USAGE
from tpweave.models.config import DTYPES, PRESETS

DESCRIPTION = """\
tpweave: sequence parallelism and async tensor parallelism for TP LLM inference, applied by
torch.compile graph passes to unmodified TP models.

Every command runs its ranks itself (gloo on CPU, NCCL with one GPU per rank), or runs as one rank of a
torchrun / SLURM job: `torchrun --nproc-per-node 2 -m tpweave demo` (detected; or --launcher torchrun).
Exit status: 0 ran and passed its checks, 1 a run or check failed, 2 bad input (nothing ran)."""

EPILOG = "TPWEAVE_LOG=debug|info prints tpweave's log; --debug shows full tracebacks of failing ranks."


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `tpweave: error: ...`, then where to find help (the command's own help for
    an option it does not know); exit status 2."""

    def error(self, message: str):  # noqa: D102  (argparse's hook)
        print(f"tpweave: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):  # noqa: D102  (argparse's entry point)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = getattr(parsed, "command_parser", self)  # the (sub)command's parser names its own help
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, unless the help already says it or there is none to say (None, a
    flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _number(text: str, convert, *, least, strict: bool, what: str):
    """`text` as a number >= least (> least when strict); ArgumentTypeError naming what was expected."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least or (strict and value == least) or value != value:
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {least}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, least=1, strict=False, what="an integer >= 1")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, least=0, strict=False, what="an integer >= 0")


def positive_float(text: str) -> float:
    """A number > 0 (seconds, rates)."""
    return _number(text, float, least=0, strict=True, what="a number")


def token_counts(text: str) -> list[int]:
    """'1,16,512' -> [1, 16, 512]: token counts >= 1."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1, got {text!r}")
    return values


def shape_pairs(text: str) -> list[tuple[int, int]]:
    """'1x2048,4x512' -> [(1, 2048), (4, 512)]: BATCHxLENGTH pairs."""
    try:
        out = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or min(p) < 1 for p in out):
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH pairs like 1x2048,4x512, got {text!r}")
    return out


# bench latency's shapes unless --prefill / --decode are given; the ones past the model's positions are left out
LATENCY_PREFILL = "1x128,1x512,1x1024,1x2048,1x4096,1x8192,1x16384,1x32768,4x512,4x2048,8x1024"
LATENCY_DECODE = "1x1024,4x1024,16x1024,64x1024,128x1024,256x1024,1x4096,16x4096,64x4096"


def rates(text: str) -> list[float]:
    """'2,8,inf' -> [2.0, 8.0, inf]: request rates > 0 per second; inf sends every request at once."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected rates like 2,8,inf, got {text!r}") from None
        if not value > 0 or math.isnan(value):
            raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {part}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"expected rates like 2,8,inf, got {text!r}")
    return out


def _model(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--model", default=default, help=f"a preset ({', '.join(sorted(PRESETS))}) or an HF-format model directory"
    )


def _ranks(p: argparse.ArgumentParser, *, timeout: float) -> None:
    p.add_argument(
        "-tp", "--tensor-parallel-size", "--tp", dest="tp", type=positive_int, default=2, help="TP degree: ranks to run"
    )
    p.add_argument(
        "--launcher",
        choices=("auto", "spawn", "torchrun"),
        default="auto",
        help="spawn: start the ranks here; torchrun: this process is one rank of torchrun/SLURM; auto: torchrun "
        "when its environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is set",
    )
    p.add_argument("--timeout", type=positive_float, default=timeout, help="seconds the whole run may take")


def _dtype(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--dtype", choices=sorted(DTYPES), default=default, help="model dtype")


def _timing(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-layers", type=positive_int, default=2, help="decoder layers timed together (reported per layer)"
    )
    p.add_argument(
        "--num-iters",
        type=positive_int,
        default=100,
        help="repetitions: timed samples per arm, arm order shuffled in each (100 keeps the A/A interval "
        "within about +-1%% on one H200: docs/user_guide.md, Benchmark)",
    )
    p.add_argument("--num-iters-warmup", type=non_negative_int, default=3, help="untimed calls per arm before capture")
    p.add_argument("--inner", type=positive_int, default=5, help="CUDA-graph replays per timed sample")
    p.add_argument(
        "--captures",
        type=positive_int,
        default=3,
        help="CUDA graphs captured per arm, the repetitions replaying them in turn (the 95%% intervals cover the "
        "variation between captures)",
    )


def _invariant(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--invariant",
        choices=("batch", "tp"),
        default=None,
        help="batch: each request's tokens bitwise the same whatever other requests share its steps; tp: also at "
        "every TP degree dividing 8 (docs/user_guide.md, Batch invariance)",
    )


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-dir",
        default=None,
        help="folder for the JSON, markdown and PNG results (default: a new tpweave-results/<name>-<timestamp>)",
    )
    p.add_argument(
        "--name", default=None, help="file name stem of the results (default: <command>-<model>-tp<N>-<dtype>)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace results of the same name in --output-dir")


def build_parser(commands: dict[str, Callable]) -> Parser:
    """The `tpweave` parser; `commands` maps each command's name ("demo", "bench layer", ...) to its function."""
    from tpweave.version import __version__

    parser = Parser(prog="tpweave", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"tpweave {__version__}")
    parser.add_argument("--debug", action="store_true", help="print full tracebacks of failing ranks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)

    def command(name: str, help_text: str, parent=sub) -> Parser:
        p = parent.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(command_parser=p)
        return p

    demo = command("demo", "run the tiny model on several ranks, eager and compiled, and check they agree")
    _model(demo, "tiny")
    _ranks(demo, timeout=900)
    _dtype(demo, "float32")
    demo.add_argument("--num-tokens", type=positive_int, default=37, help="tokens in the batch (M)")
    demo.add_argument("--no-compile", action="store_true", help="eager forward only")
    demo.add_argument("--show-report", action="store_true", help="print the full compile report (every site)")
    demo.set_defaults(fn=commands["demo"])

    cal = command("calibrate", "time every strategy per collective site and M; write the strategy table")
    _model(cal, "llama3-8b")
    _ranks(cal, timeout=3600)
    _dtype(cal, "bfloat16")
    _timing(cal)
    cal.add_argument(
        "--num-tokens", type=token_counts, default="1,16,64,256,512,1024,2048,4096,8192,16384", help="M grid"
    )
    cal.set_defaults(fn=commands["calibrate"])

    gen = command("generate", "generate with the reference engine (preset: token ids; directory with tokenizer: text)")
    _model(gen, "tiny")
    _ranks(gen, timeout=1800)
    _dtype(gen, "bfloat16")
    gen.add_argument("--prompt", action="append", help="text prompt (repeatable; needs a tokenizer in --model)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeatable)")
    gen.add_argument("--num-prompts", type=positive_int, default=4, help="random prompts when none are given")
    gen.add_argument("--max-tokens", type=positive_int, default=16, help="new tokens per prompt at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--seed", type=int, default=0, help="sampling and random-prompt seed")
    gen.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    gen.add_argument("--max-num-seqs", type=positive_int, default=32, help="sequences per step at most")
    gen.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="tokens per step at most")
    gen.add_argument(
        "--num-gpu-blocks-override",
        type=positive_int,
        default=None,
        help="KV-cache blocks (default: from free GPU memory; 256 on CPU)",
    )
    gen.add_argument("--num-layers", type=positive_int, default=None, help="override the model's layer count")
    gen.add_argument("--baseline", action="store_true", help="plain TP (NCCL all-reduce), no SP / async TP")
    gen.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (neither the decode graphs nor the piecewise prefill graphs)",
    )
    gen.add_argument("--no-compile", action="store_true", help="run the model uncompiled")
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each generated token's log-probability under the model, and the K most likely tokens' (0 to 20)",
    )
    _invariant(gen)
    gen.set_defaults(fn=commands["generate"])

    srv = command("serve", "an OpenAI-compatible HTTP server over the engine (/v1/completions, /v1/chat/completions)")
    _model(srv, "tiny")
    _ranks(srv, timeout=float("inf"))
    srv.set_defaults(tp=1)
    _dtype(srv, "bfloat16")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    srv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set TPWEAVE_API_KEY)")
    srv.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step at most")
    srv.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="tokens per step at most")
    srv.add_argument("--max-model-len", type=positive_int, default=None, help="context length (default: the model's)")
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for the engine")
    srv.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    srv.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                     help="KV-cache blocks (default: from free GPU memory; 256 on CPU)")  # fmt: skip
    srv.add_argument("--max-pending", type=positive_int, default=1024,
                     help="requests held at once (running and queued); more get 503")  # fmt: skip
    srv.add_argument("--shutdown-timeout", type=positive_float, default=30.0,
                     help="seconds requests in flight get to finish after SIGINT / SIGTERM, then aborted")  # fmt: skip
    srv.add_argument("--num-layers", type=positive_int, default=None, help="override the model's layer count")
    srv.add_argument("--baseline", action="store_true", help="plain TP (NCCL all-reduce), no SP / async TP")
    srv.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    srv.add_argument("--no-compile", action="store_true", help="run the model uncompiled")
    _invariant(srv)
    srv.set_defaults(fn=commands["serve"])

    bench = command("bench", "benchmarks: layer, latency, serve, engine")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True, parser_class=Parser)
    layer = command("layer", "per layer and per op: baseline, SP, SP + fused ops, auto, compute-only", bench_sub)
    _model(layer, "llama3-8b")
    _ranks(layer, timeout=3600)
    _dtype(layer, "bfloat16")
    _timing(layer)
    layer.add_argument(
        "--num-tokens", type=token_counts, default="1,16,128,512,1024,2048,4096,8192,16384", help="M values"
    )
    layer.add_argument("--no-ops", action="store_true", help="skip the per-op table")
    _output(layer)
    layer.set_defaults(fn=commands["bench layer"])

    lat = command("latency", "whole model: prefill TTFT and decode TPOT per arm, kernel verification", bench_sub)
    _model(lat, "llama3-8b")
    _ranks(lat, timeout=3600)
    _dtype(lat, "bfloat16")
    _timing(lat)
    lat.set_defaults(num_layers=None)
    lat.add_argument(
        "--prefill",
        type=shape_pairs,
        help=f"BATCHxINPUT_LEN pairs (default: those of {LATENCY_PREFILL} within the model's positions)",
    )
    lat.add_argument(
        "--decode",
        type=shape_pairs,
        help=f"BATCHxCONTEXT pairs (default: those of {LATENCY_DECODE} within the model's positions)",
    )
    lat.add_argument("--no-verify", action="store_true", help="skip the profiler check of which kernels ran")
    _output(lat)
    lat.set_defaults(fn=commands["bench latency"])

    serve = command("serve", "Poisson arrivals through the engine: TTFT, TPOT, ITL, throughput per arm", bench_sub)
    _model(serve, "llama3-8b")
    _ranks(serve, timeout=3600)
    _dtype(serve, "bfloat16")
    serve.add_argument("--num-layers", type=positive_int, default=None, help="override the model's layer count")
    serve.add_argument(
        "--arms",
        default="baseline,auto",
        help="comma-separated, the first the others are compared with: baseline (plain TP), auto (tpweave), auto_aa "
        "(tpweave again: the A/A control), prefill_eager (tpweave, prefill and mixed steps without CUDA graphs), "
        "prefill_piecewise (tpweave, prefill and mixed steps from piecewise graphs instead of whole-step ones)",
    )
    serve.add_argument(
        "--workload",
        default="azure-code,azure-conv,sharegpt",
        help="comma-separated named workloads, lognormal lengths around published statistics: azure-code "
        "(prompt median 1500, output median 13 tokens: prefill-heavy), azure-conv (1020 / 129), both from the "
        "Azure LLM inference trace 2023 (Splitwise, ISCA 2024); sharegpt (mean 161 / 338: decode-heavy, vLLM's "
        "SOSP 2023 statistics)",
    )
    serve.add_argument(
        "--dataset-path",
        "--requests-file",
        dest="dataset_path",
        default=None,
        help="JSON list or CSV of requests with input_len, output_len[, arrival_s] (replaces --workload)",
    )
    serve.add_argument(
        "--request-rate",
        type=rates,
        default="2,8,32,inf",
        help="requests per second, comma-separated, a sweep up to saturation; inf: all at once",
    )
    serve.add_argument("--num-prompts", type=positive_int, default=200, help="requests per workload, rate and round")
    serve.add_argument(
        "--rounds", type=positive_int, default=3, help="rounds over every cell, the arms interleaved in each"
    )
    serve.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step at most")
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="tokens per step at most")
    serve.add_argument("--max-model-len", type=positive_int, default=8192, help="context length (tokens)")
    serve.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    serve.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompts")
    serve.add_argument("--backend", choices=("inprocess", "openai"), default="inprocess",
                       help="inprocess: the engine driven here, per --arms; openai: the same trace sent over HTTP "
                       "(streamed /v1/completions) to the OpenAI-compatible server at --base-url")  # fmt: skip
    serve.add_argument("--base-url", default=None, help="with --backend openai: e.g. http://127.0.0.1:8000/v1")
    serve.add_argument("--api-key", default=None, help="with --backend openai: sent as `Authorization: Bearer KEY`")
    serve.add_argument("--served-model-name", default=None,
                       help="with --backend openai: the `model` to send (default: the server's first)")  # fmt: skip
    serve.add_argument("--max-concurrency", type=positive_int, default=None,
                       help="with --backend openai: requests in flight at most (default: no limit)")  # fmt: skip
    _output(serve)
    serve.set_defaults(fn=commands["bench serve"])

    eng = command(
        "engine", "the reference engine: decode step vs graph-replayed forward vs HBM roofline, prefill", bench_sub
    )
    _model(eng, "llama3-8b")
    _ranks(eng, timeout=3600)
    eng.set_defaults(tp=1)
    _dtype(eng, "bfloat16")
    eng.add_argument("--num-layers", type=positive_int, default=None, help="override the model's layer count")
    eng.add_argument("--batch-sizes", type=token_counts, default="1,64,256", help="decode batches (sequences)")
    eng.add_argument("--context", type=positive_int, default=1024, help="tokens of context per decoding sequence")
    eng.add_argument("--prefill", type=token_counts, default="2048", help="prompt lengths of the prefill rows")
    eng.add_argument("--num-iters", type=positive_int, default=64, help="timed engine steps per decode batch")
    eng.add_argument("--num-iters-warmup", type=non_negative_int, default=8, help="untimed steps before them")
    eng.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (neither the decode graphs nor the piecewise prefill graphs)",
    )
    eng.add_argument("--no-compile", action="store_true", help="run the model uncompiled")
    eng.add_argument("--sync-scheduling", action="store_true", help="read each step's tokens before planning the next")
    eng.add_argument(
        "--baseline",
        action="store_true",
        help="plain TP: no SP, async TP or token split (the all-reduces NCCL's; with --invariant its ordered one)",
    )
    _invariant(eng)
    _output(eng)
    eng.set_defaults(fn=commands["bench engine"])

    rep = command("report", "render result JSON files as one markdown report with PNG plots")
    rep.add_argument("results", nargs="+", help="result JSON files written by tpweave bench")
    rep.add_argument(
        "--output-dir", default=None, help="folder for the report (default: a new tpweave-results/report-<timestamp>)"
    )
    rep.add_argument("--name", default="REPORT.md", help="the report's file name")
    rep.add_argument("--overwrite", action="store_true", help="replace a report of the same name in --output-dir")
    rep.add_argument("--summary-only", action="store_true", help="only the summary tables (what READMEs quote)")
    rep.set_defaults(fn=commands["report"])
    return parser
