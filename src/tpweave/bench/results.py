"""Benchmark results: JSON with the run's metadata, and a markdown rendering."""
from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def run_metadata(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import os

    commit = os.environ.get("TPWEAVE_COMMIT", "")  # set where the tree has no .git (the GPU box's copy)
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "commit": commit or "unknown",
        "command": " ".join(shlex.quote(a) for a in ["tpweave", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


LAYER_COLUMNS = ["tokens", "arm", "ms_per_layer", "vs_baseline", "hidden", "of_compute_only", "spread", "peak_mem_bytes", "auto_variant"]
OP_COLUMNS = ["site", "tokens", "arm", "ms", "vs_sequential", "hidden", "spread"]


def write_results(out_dir: str | Path, name: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    parts = [f"# {name}", "", "| | |", "|---|---|", *[f"| {k} | `{v}` |" for k, v in meta.items()], ""]
    layer_rows = [r for r in rows if r.get("what") == "layer"]
    op_rows = [r for r in rows if r.get("what") == "op"]
    if layer_rows:
        parts += ["## Decoder layer", "", markdown_table(layer_rows, LAYER_COLUMNS), ""]
    if op_rows:
        parts += ["## Overlapped ops", "", markdown_table(op_rows, OP_COLUMNS), ""]
    from tpweave.bench.plots import plot_layer_speedup

    png = plot_layer_speedup(rows, f"{meta.get('model', '')} TP={meta.get('tp', '')} {meta.get('dtype', '')} on {meta.get('device', '')}", out / f"{name}.png")
    if png is not None:
        parts[1:1] = ["", f"![speedup per arm]({png.name})", ""]
    md_path.write_text("\n".join(parts))
    return json_path, md_path
