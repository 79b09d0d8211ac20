"""Benchmark results: JSON with the run's metadata, and a markdown rendering."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch


def run_metadata(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Device, GPU count, torch version, the code (tpweave's commit and dirty flag, or its version and a
    hash of its sources: bench/provenance.py), command line and UTC date of this run, merged with `extra`."""
    from tpweave.bench.provenance import code_version

    code = code_version()
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "commit": code["commit"] or f"none (sources sha256:{code['source_hash']})",
        "code": code,
        "command": " ".join(shlex.quote(a) for a in ["tpweave", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **(extra or {}),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A markdown table of `rows` restricted to `columns`; missing values show as "-", floats with 4 digits."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


LAYER_COLUMNS = [
    "tokens",
    "arm",
    "ms_per_layer",
    "vs_baseline",
    "hidden",
    "of_compute_only",
    "spread",
    "peak_mem_bytes",
    "auto_variant",
]
OP_COLUMNS = ["site", "tokens", "arm", "ms", "vs_sequential", "hidden", "spread"]
PREFILL_COLUMNS = [
    "batch",
    "input_len",
    "tokens",
    "arm",
    "ms",
    "vs_baseline",
    "hidden",
    "of_compute_only",
    "spread",
    "peak_mem_bytes",
    "variant",
]
DECODE_COLUMNS = ["batch", "context", "arm", "ms", "vs_baseline", "hidden", "of_compute_only", "spread", "variant"]
SERVE_COLUMNS = [
    "workload",
    "rate",
    "arm",
    "num_finished",
    "num_failed",
    "request_throughput",
    "output_token_throughput",
    "total_token_throughput",
    "vs_baseline",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "tpot_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
]
# (row kind, section title, columns, plot: (x key, y key, x label, y label) or None)
SECTIONS = (
    (
        "layer",
        "Decoder layer",
        LAYER_COLUMNS,
        ("tokens", "vs_baseline", "tokens per step (M)", "speedup over baseline TP (per layer)"),
    ),
    ("op", "Overlapped ops", OP_COLUMNS, None),
    (
        "prefill",
        "Prefill (time to first token)",
        PREFILL_COLUMNS,
        ("tokens", "vs_baseline", "prompt tokens in the step (M)", "TTFT speedup over baseline TP"),
    ),
    (
        "decode",
        "Decode (time per output token)",
        DECODE_COLUMNS,
        ("batch", "vs_baseline", "decode batch", "TPOT speedup over baseline TP"),
    ),
    ("serve", "Serving", SERVE_COLUMNS, None),
)


def render(name: str, meta: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> str:
    """Markdown of one result: its metadata, a table per row kind, PNG plots next to it."""
    from tpweave.bench.plots import plot_serve, plot_speedup

    title = f"{meta.get('model', '')} TP={meta.get('tp', '')} {meta.get('dtype', '')} on {meta.get('device', '')}"
    parts = [
        f"# {name}",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | `{v}` |" for k, v in meta.items() if k != "kernels"],
        "",
    ]
    if meta.get("failures"):
        parts += [f"**Failures:** {meta['failures']}", ""]
    for kind, section, columns, plot in SECTIONS:
        kind_rows = [r for r in rows if r.get("what") == kind]
        if not kind_rows:
            continue
        parts += [f"## {section}", ""]
        png = None
        if plot is not None:
            png = plot_speedup(kind_rows, plot, f"{section}: {title}", out / f"{name}-{kind}.png")
        elif kind == "serve":
            png = plot_serve(kind_rows, f"{section}: {title}", out / f"{name}-{kind}.png")
        if png is not None:
            parts += [f"![{section}]({png.name})", ""]
        parts += [markdown_table(kind_rows, columns), ""]
    kernels = meta.get("kernels")
    if kernels:
        parts += ["## Communication kernels per forward (torch.profiler)", ""]
        for phase, arms in kernels.items():
            for arm, counts in arms.items():
                comm = ", ".join(f"{k} x{v:g}" for k, v in counts["comm_kernels"].items()) or "none"
                parts.append(f"- {phase} / {arm}: {comm}")
        parts.append("")
    return "\n".join(parts)


def write_results(
    out_dir: str | Path, name: str, meta: dict[str, Any], rows: list[dict[str, Any]]
) -> tuple[Path, Path]:
    """Write `name`.json (metadata and rows) and `name`.md (with its PNG plots) into `out_dir`, creating it;
    (JSON path, markdown path)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md_path.write_text(render(name, meta, rows, out))
    return json_path, md_path


def load_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metadata, rows) of a JSON file written by write_results; ValueError naming the file and what is
    wrong when it is not one (unreadable, no meta/rows, rows of no benchmark kind)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a tpweave results file (expected an object with 'meta' and 'rows')")
    kinds = {kind for kind, *_ in SECTIONS}
    if not data["rows"] or not all(isinstance(r, dict) and r.get("what") in kinds for r in data["rows"]):
        raise ValueError(
            f"{path}: not a tpweave results file (rows must be benchmark rows: {', '.join(sorted(kinds))})"
        )
    return data["meta"], data["rows"]
