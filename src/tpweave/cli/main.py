"""`tpweave`'s entry point: parse, run the command, turn every failure into one line and an exit status."""

from __future__ import annotations

import os
import sys

from tpweave.cli.bench import cmd_bench_engine, cmd_bench_latency, cmd_bench_layer, cmd_bench_serve, cmd_calibrate
from tpweave.cli.demo import cmd_demo
from tpweave.cli.errors import EXIT_FAILED, EXIT_USAGE, CLIError
from tpweave.cli.generate import cmd_generate
from tpweave.cli.parser import build_parser
from tpweave.cli.ranks import launcher_in_use
from tpweave.cli.report import cmd_report
from tpweave.cli.serve import cmd_serve
from tpweave.log import configure_from_env

COMMANDS = {
    "demo": cmd_demo,
    "calibrate": cmd_calibrate,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "bench layer": cmd_bench_layer,
    "bench latency": cmd_bench_latency,
    "bench serve": cmd_bench_serve,
    "bench engine": cmd_bench_engine,
    "report": cmd_report,
}


def main(argv: list[str] | None = None) -> int:
    """Run `tpweave ARGS` (default: sys.argv[1:]); the exit status (0 ok, 1 a run or check failed, 2 bad input)."""
    from tpweave.runtime import WorkerError

    args = build_parser(COMMANDS).parse_args(argv)
    configure_from_env()
    if hasattr(args, "launcher") and launcher_in_use(args.launcher) == "torchrun" and os.environ.get("RANK") != "0":
        sys.stdout = open(os.devnull, "w")  # one writer: rank 0
    try:
        return args.fn(args)
    except (CLIError, ValueError) as e:
        print(f"tpweave: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerError as e:
        if args.debug:
            print(str(e), file=sys.stderr)
        print(f"tpweave: error: rank {e.rank}: {e.summary}", file=sys.stderr)
        if not args.debug:
            print("tpweave: (run with --debug for every rank's traceback)", file=sys.stderr)
        return EXIT_FAILED
    except TimeoutError as e:
        print(f"tpweave: error: {e} (raise --timeout if the run is just slow)", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("tpweave: interrupted", file=sys.stderr)
        return 130
