"""`tpweave report`: result JSON files -> one markdown report with PNG plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from tpweave.cli.errors import EXIT_OK, CLIError
from tpweave.cli.output import results_dir


def cmd_report(args: argparse.Namespace) -> int:
    """Check every input is a results file (before writing anything), then write one report: the summary
    of every run's headline ratios (what README files quote), then each run in full (unless --summary-only)."""
    from tpweave.bench.provenance import code_version
    from tpweave.bench.results import load_results, render, summary

    loaded = []
    for path in args.results:
        try:
            loaded.append((path, *load_results(path)))
        except ValueError as e:
            raise CLIError(str(e)) from None
    out = results_dir(args.output_dir, "report", files=[args.name], overwrite=args.overwrite)
    named = [(str(Path(path)), meta, rows) for path, meta, rows in loaded]
    parts = [summary(named, head_commit=code_version()["commit"], summary_only=args.summary_only)]
    if not args.summary_only:
        parts += [render(Path(path).stem, meta, rows, out) for path, meta, rows in loaded]
    report = "\n\n".join(parts) + "\n"
    (out / args.name).write_text(report)
    print(report)
    print(f"wrote {out / args.name}")
    return EXIT_OK
