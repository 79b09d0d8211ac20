"""Benchmark results: JSON with the run's metadata, and a markdown rendering."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from tpweave.bench.stats import AA_NOISE, within_aa_noise


def run_metadata(
    extra: dict[str, Any] | None = None, *, gpus_start: list | None = None, gpu_samples: dict | None = None
) -> dict[str, Any]:
    """Provenance of this run, found by the tool (bench/provenance.py): the code (tpweave's commit and
    dirty flag, or its version and a hash of its sources), torch / Triton / NCCL / CUDA versions, the
    GPUs' clocks and temperatures at the start (`gpus_start`) and now, and sampled through the run
    (`gpu_samples`: provenance.GpuSampler's summary), the communication environment
    variables, whether tpweave's and Inductor's kernels launch with PDL (ops/pdl.py), the command line and UTC
    date; merged with `extra`."""
    from tpweave.bench.provenance import code_version, describe, environment, gpu_state, versions
    from tpweave.ops import pdl

    code = code_version()
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "commit": code["commit"] if code["dirty"] is False else describe(code),
        "code": code,
        "versions": versions(),
        "gpus_start": gpus_start,
        "gpus_end": gpu_state(),
        "gpu_samples": gpu_samples,
        "env": environment(),
        "pdl": torch.cuda.is_available() and pdl.enabled(torch.device("cuda")),
        "command": " ".join(shlex.quote(a) for a in ["tpweave", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **(extra or {}),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict) and {"ratio", "lo", "hi"} <= v.keys():  # a ratio with its 95% interval
        text = f"{v['ratio']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"
        if v.get("flagged"):
            return text + " A/A FLAGGED"
        if v.get("verdict") == AA_NOISE:
            return text + " n.s. (A/A)"
        return text if v.get("verdict") in ("faster", "slower") or "flagged" in v else text + " n.s."
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A markdown table of `rows` restricted to `columns`; missing values show as "-", floats with 4 digits."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# Ratios are median(base) / median(arm) with their 95% interval; "n.s." = the interval holds 1.0 (no
# significant difference), "n.s. (A/A)" = it does not, but the ratio lies within the A/A control's half-width.
# vs_plain_best is the headline (the strongest plain TP torch gives), vs_plain_nccl beside it; aa (on auto's row) is
# auto vs its independently captured copy.
RATIO_COLUMNS = ["vs_plain_best", "vs_plain_nccl", "aa"]
LAYER_COLUMNS = [
    "tokens",
    "arm",
    "ms_per_layer",
    *RATIO_COLUMNS,
    "hidden",
    "of_compute_only",
    "spread",
    "variant",
    "chosen",
]
OP_COLUMNS = ["site", "tokens", "arm", "ms", "vs_sequential", "hidden", "spread"]
PREFILL_COLUMNS = ["batch", "input_len", "tokens", "arm", "ms", *RATIO_COLUMNS, "hidden", "of_compute_only", "spread",
                   "peak_mem_bytes", "variant", "chosen"]  # fmt: skip
DECODE_COLUMNS = ["batch", "context", "arm", "ms", *RATIO_COLUMNS, "hidden", "of_compute_only", "spread", "variant",
                  "chosen"]  # fmt: skip
SERVE_COLUMNS = ["workload", "rate", "arm", "rounds", "num_finished", "num_failed", "num_lost", "request_throughput",
                 "output_token_throughput", "vs_baseline", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                 "itl_ms_p50", "itl_ms_p99"]  # fmt: skip
ENGINE_DECODE_COLUMNS = ["batch", "context", "step_ms", "step_ms_p90", "forward_ms", "step_over_forward", "roofline_ms",
                         "of_roofline", "gemm_ms", "attention_ms", "other_ms", "kernels_per_step",
                         "kernels_per_forward", "copies_per_step", "graph_bucket"]  # fmt: skip
ENGINE_PREFILL_COLUMNS = ["tokens", "padded_to", "path", "forward_ms", "single_call_ms", "graph_forward_ms",
                          "single_over_graph", "eager_single_ms", "request_ms", "roofline_ms", "of_roofline",
                          "of_datasheet_peak", "tokens_per_s", "gemm_ms", "attention_ms", "other_ms"]  # fmt: skip
ENGINE_MIXED_COLUMNS = ["decodes", "context", "chunk", "tokens", "padded_to", "path", "forward_ms", "single_call_ms",
                        "graph_forward_ms", "single_over_graph", "eager_single_ms", "host_ms", "kernel_ms",
                        "graph_kernel_ms", "peak_bytes_eager", "peak_bytes_engine"]  # fmt: skip
# (row kind, section title, columns, plot: (x key, y key, x label, y label) or None)
SECTIONS = (
    (
        "layer",
        "Decoder layer",
        LAYER_COLUMNS,
        ("tokens", "vs_plain_best", "tokens per step (M)", "speedup over plain_best TP (per layer), 95% CI"),
    ),
    ("op", "Overlapped ops", OP_COLUMNS, None),
    (
        "prefill",
        "Prefill (time to first token)",
        PREFILL_COLUMNS,
        ("tokens", "vs_plain_best", "prompt tokens in the step (M)", "TTFT speedup over plain_best TP, 95% CI"),
    ),
    (
        "decode",
        "Decode (time per output token)",
        DECODE_COLUMNS,
        ("batch", "vs_plain_best", "decode batch", "TPOT speedup over plain_best TP, 95% CI"),
    ),
    ("serve", "Serving", SERVE_COLUMNS, None),
    ("engine_decode", "Engine decode step (steady state) vs forward vs HBM roofline", ENGINE_DECODE_COLUMNS, None),
    ("engine_prefill", "Engine prefill vs matmul roofline", ENGINE_PREFILL_COLUMNS, None),
    (
        "engine_mixed",
        "Engine mixed step (decodes + a prefill chunk) vs its graph-replayed forward",
        ENGINE_MIXED_COLUMNS,
        None,
    ),
)


# Metadata kept in the JSON but summarized (provenance_lines), not dumped, in the markdown
BULKY_META = {"kernels", "compile_reports", "orders", "code", "versions", "gpus_start", "gpus_end", "gpu_samples",
              "env", "table", "fallbacks", "verification_problems", "failures", "aa", "compile_report",
              "engines"}  # fmt: skip
# bench serve's meta["engines"] (bench/serve.py engine_stats), one row per arm
SERVE_ENGINE_COLUMNS = ["arm", "build_s", "step_capture_s", "decode_capture_s", "graph_memory_bytes", "num_blocks",
                        "steps_decode_graph", "steps_whole_graph", "steps_piecewise", "steps_eager",
                        "padded_tokens_per_step", "padded_fraction", "peak_step_bytes"]  # fmt: skip


def proof_text(meta: dict[str, Any]) -> str:
    """The kernel proof of a run in words: FAILED with its problems; "n/a" where nothing was profiled (CPU) or
    nothing expected (an arm that communicates nothing certifies nothing); else which arms it proved at how
    many shapes. Runs recorded before proofs had a status say so."""
    problems = meta.get("verification_problems") or []
    if problems:
        return "FAILED: " + "; ".join(problems)
    statuses: dict[str, dict[str, int]] = {}
    for arms in (meta.get("kernels") or {}).values():
        for arm, seen in arms.items():
            if "proof" in seen:
                counts = statuses.setdefault(arm, {})
                counts[seen["proof"]] = counts.get(seen["proof"], 0) + 1
    if not meta.get("kernels") or not any(meta["kernels"].values()):
        return "n/a (nothing profiled: no GPU kernels to count)"
    if not statuses:
        return "passed (recorded before proofs had an n/a status: an arm that expected no kernel passed too)"
    proved = sorted(a for a, c in statuses.items() if set(c) == {"proved"})
    empty = sorted(a for a, c in statuses.items() if set(c) == {"n/a"})
    mixed = sorted(a for a, c in statuses.items() if a not in proved and a not in empty)
    parts = []
    if proved:
        parts.append(f"passed for {', '.join(proved)} at every shape")
    if mixed:
        for a in mixed:
            parts.append(f"{a}: proved at {statuses[a].get('proved', 0)} shapes, n/a at {statuses[a].get('n/a', 0)}")
    if empty:
        parts.append(f"n/a for {', '.join(empty)} (no kernel expected: certifies nothing)")
    return "; ".join(parts)


def provenance_lines(meta: dict[str, Any]) -> list[str]:
    """Markdown lines: code, versions, GPU clocks at start and end, environment, calibration table,
    kernel proof and fallbacks, the A/A control."""
    from tpweave.bench.provenance import describe

    lines = []
    if meta.get("code"):
        lines.append(f"- code: {describe(meta['code'])}")
    if meta.get("versions"):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
    for when in ("gpus_start", "gpus_end"):
        for g in meta.get(when) or []:
            clocks = f"SM {g.get('clocks_sm')} of {g.get('clocks_max_sm')} MHz"
            lines.append(f"- GPU {g.get('index')} at {when[5:]}: {g.get('name')}, {clocks}, "
                         f"{g.get('temperature_gpu')} C, {g.get('power_draw')} W")  # fmt: skip
    samples = meta.get("gpu_samples")
    if samples:
        if samples.get("file"):
            for i, g in samples.get("per_gpu", {}).items():
                sm, power = g.get("sm_clock_mhz") or ["?"] * 3, g.get("power_w") or ["?"] * 3
                lines.append(f"- GPU {i} through the run ({samples['samples']} samples, {samples['file']}): SM clock "
                             f"{sm[0]} / {sm[1]} / {sm[2]} MHz, power {power[0]} / {power[1]} / {power[2]} W "
                             "(min / median / max)")  # fmt: skip
        else:
            lines.append(f"- GPU clocks through the run: {samples.get('why')}")
    if meta.get("env"):
        lines.append("- environment: " + ", ".join(f"{k}={v}" for k, v in meta["env"].items()))
    if "pdl" in meta:
        lines.append(f"- programmatic dependent launch: {'on' if meta['pdl'] else 'off'}")
    if "table" in meta:
        table = meta["table"]
        lines.append(
            f"- calibration table: {table['sha256']} ({table['file']})" if table else "- calibration table: none"
        )
    if "verification_problems" in meta:
        lines.append(f"- kernel proof at every M: {proof_text(meta)}")
    if "fallbacks" in meta:
        lines.append(f"- compile fallbacks: {'; '.join(meta['fallbacks']) if meta['fallbacks'] else 'none'}")
    if meta.get("aa"):
        lines.append(f"- A/A control: {meta['aa']}")
    return lines


def render(name: str, meta: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> str:
    """Markdown of one result: its metadata, a table per row kind, PNG plots next to it."""
    from tpweave.bench.plots import plot_engine, plot_serve, plot_speedup

    title = f"{meta.get('model', '')} TP={meta.get('tp', '')} {meta.get('dtype', '')} on {meta.get('device', '')}"
    parts = [f"# {name}", "", *provenance_lines(meta), "", "| | |", "|---|---|"]
    parts += [f"| {k} | `{v}` |" for k, v in meta.items() if k not in BULKY_META]
    parts.append("")
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
        elif kind == "engine_decode":
            png = plot_engine(kind_rows, f"Decode: {title}", out / f"{name}-{kind}.png")
        if png is not None:
            parts += [f"![{section}]({png.name})", ""]
        parts += [markdown_table(kind_rows, columns), ""]
    engines = meta.get("engines")
    if engines:
        parts += ["## Engines per arm: what their graphs cost, how the served steps ran", ""]
        parts += [markdown_table([{"arm": arm, **stats} for arm, stats in engines.items()], SERVE_ENGINE_COLUMNS), ""]
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


def _ratio_text(v: Any) -> str:
    if isinstance(v, dict):
        return _fmt(v)
    return "-" if v is None else f"{v:.3f} (no interval)"


def summary(
    results: list[tuple[str, dict[str, Any], list[dict[str, Any]]]],
    *,
    head_commit: str | None = None,
    summary_only: bool = True,
) -> str:
    """The tables README files quote, generated from results (name, meta, rows): per run its provenance,
    kernel-proof and A/A status, and auto's headline ratios: vs plain_best, vs plain_nccl, A/A, with 95%
    intervals. Runs of the earlier harness (arm "baseline" = plain TP with NCCL, no intervals, no A/A)
    are marked as such; a run taken at a commit other than `head_commit` says so. `summary_only`: how the report
    was asked for (its first line says)."""
    from tpweave.bench.provenance import commit_of_sources, describe

    how = "tpweave report --summary-only" if summary_only else "tpweave report"
    parts = ["# Summary of results", "",
             f"Generated by `{how}` from the result files named below; never edited by hand. Ratios: median(base) / "
             "median(auto), > 1 = auto faster; [95% interval]; n.s. = no significant difference; n.s. (A/A) = the "
             "interval excludes 1.0 by less than the A/A control's half-width.", ""]  # fmt: skip
    for name, meta, rows in results:
        legacy = not any("vs_plain_best" in r or r.get("what", "").startswith("engine_") for r in rows)
        commit = meta.get("commit", "unknown")
        parts.append(f"## {name}")
        parts.append("")
        what = f"{meta.get('kind', 'layer')} {meta.get('model', '')} TP={meta.get('tp', '')} {meta.get('dtype', '')}"
        code = describe(meta["code"]) if meta.get("code") else f"commit `{commit}` (a label set by hand)"
        parts.append(f"- {what} on {meta.get('device', '?')}, {meta.get('date', '?')}; code: {code}")
        if meta.get("code"):
            clean = meta["code"].get("commit") if meta["code"].get("dirty") is False else None
            commit = clean or commit_of_sources(meta["code"].get("source_hash")) or "unknown"
        if head_commit and not str(commit).startswith(head_commit[:7]) and not head_commit.startswith(str(commit)):
            parts.append(f"- taken at commit `{commit[:10]}`: older than the code this summary was generated with")
        if legacy:
            parts.append("- earlier harness: baseline = plain TP with NCCL all-reduce (not plain_best), fixed arm "
                         "order, no raw samples, no intervals, no A/A control")  # fmt: skip
        problems = meta.get("verification_problems")
        if meta.get("kind") == "engine":
            parts.append("- kernels: counted per step by torch.profiler (the engine benchmark has no arms to prove)")
        elif problems is None:
            parts.append("- kernel proof: not recorded")
        else:
            parts.append(f"- kernel proof: {proof_text(meta)}")
        if meta.get("aa"):
            parts.append(f"- A/A control: {meta['aa']}")
        if meta.get("failures"):
            parts.append(f"- failures: {meta['failures']}")
        parts.append("")
        parts += _headline_table(rows, legacy)
        parts.append("")
    return "\n".join(parts)


def _engine_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| phase | batch x context / tokens | engine step / forward | of roofline | kernels per step |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r.get("what") == "engine_decode":
            lines.append(f"| decode | {r['batch']}x{r['context']} | {_fmt(r.get('step_over_forward'))} | "
                         f"{_fmt(r.get('of_roofline'))} (HBM) | {_fmt(r.get('kernels_per_step'))} |")  # fmt: skip
        elif r.get("what") == "engine_prefill":
            sheet = f"; {_fmt(r['of_datasheet_peak'])} of the datasheet peak" if r.get("of_datasheet_peak") else ""
            ratio = f"{_fmt(r['single_over_graph'])} (one call / graph)" if r.get("single_over_graph") else "-"
            lines.append(f"| prefill | {r['tokens']} | {ratio} | {_fmt(r.get('of_roofline'))} (matmul{sheet}) | - |")
        elif r.get("what") == "engine_mixed":
            lines.append(f"| mixed | {r['decodes']}x{r['context']} + {r['chunk']} | "
                         f"{_fmt(r.get('single_over_graph'))} (one call / graph) | - | - |")  # fmt: skip
    return lines


def _headline_table(rows: list[dict[str, Any]], legacy: bool) -> list[str]:
    if any(r.get("what", "").startswith("engine_") for r in rows):
        return _engine_table(rows)
    auto = [r for r in rows if r.get("arm") == "auto" and r.get("what") in ("layer", "prefill", "decode", "serve")]
    for r in auto:  # results written before the A/A yardstick (bench/stats.py) read the same way
        within_aa_noise(r, r.get("aa"))
    if not auto:
        return ["(no auto arm)"]
    if auto[0]["what"] == "serve":
        lines = ["| workload | rate | output throughput auto / baseline |", "|---|---|---|"]
        return lines + [f"| {r['workload']} | {r['rate']} | {_ratio_text(r.get('vs_baseline'))} |" for r in auto]
    if legacy:
        lines = ["| phase | M | batch x length | auto vs plain NCCL |", "|---|---|---|---|"]
        return lines + [
            f"| {r['what']} | {r['tokens']} | {_shape(r)} | {_ratio_text(r.get('vs_baseline'))} |" for r in auto
        ]
    lines = [
        "| phase | M | batch x length | auto vs plain_best | auto vs plain_nccl | A/A |",
        "|---|---|---|---|---|---|",
    ]
    return lines + [
        f"| {r['what']} | {r['tokens']} | {_shape(r)} | {_ratio_text(r.get('vs_plain_best'))} | "
        f"{_ratio_text(r.get('vs_plain_nccl'))} | {_ratio_text(r.get('aa'))} |"
        for r in auto
    ]


def _shape(r: dict[str, Any]) -> str:
    if "batch" in r:
        return f"{r['batch']}x{r.get('input_len', r.get('context'))}"
    return "-"
