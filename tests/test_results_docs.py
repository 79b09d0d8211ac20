"""Numbers in the READMEs come from committed results, through the generated summary, never typed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpweave.bench.provenance import code_version
from tpweave.bench.results import load_results, summary

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "benchmarks" / "results" / "SUMMARY.md"
QUOTING = [ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md", ROOT / "docs" / "status.md"]
# A ratio as the summary prints it: 0.5 .. 2.0 with 2-3 decimals, not part of a version (2.13.0) or a longer number
RATIO = re.compile(r"(?<![\d.])([0-2]\.\d{2,3})(?![\d.])")


def _without_commit_age(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("- taken at commit"))


def quoted_ratios_not_in(text: str, source: str) -> list[str]:
    """Ratio-like numbers of `text` that `source` does not contain."""
    found = [m for m in RATIO.findall(text) if 0.5 <= float(m) < 2.0]
    return sorted({m for m in found if m not in source})


def test_summary_is_generated_from_the_committed_results():
    text = SUMMARY.read_text()
    files = re.findall(r"^## (\S+\.json)$", text, re.M)
    assert files, "SUMMARY.md names no result file"
    results = [(f, *load_results(ROOT / f)) for f in files]
    generated = summary(results, head_commit=code_version()["commit"])
    assert _without_commit_age(generated).strip() == _without_commit_age(text).strip(), (
        "benchmarks/results/SUMMARY.md is not what `tpweave report --summary-only` generates from the files it "
        "names: regenerate it (benchmarks/results/README.md has the command)"
    )


def test_every_quoted_ratio_is_in_a_committed_result():
    source = SUMMARY.read_text()
    for doc in QUOTING:
        missing = quoted_ratios_not_in(doc.read_text(), source)
        assert not missing, f"{doc.relative_to(ROOT)} quotes {missing}, which no committed result holds"


def test_the_check_catches_a_typed_number():
    source = "| layer | 512 | - | 1.096 (no interval) |"
    assert quoted_ratios_not_in("auto is 1.096x faster", source) == []
    assert quoted_ratios_not_in("auto is 1.12x faster on torch 2.13.0", source) == ["1.12"]


def test_sources_map_to_the_commit_that_brought_them_in():
    """A result's sources name the commit that introduced them, not the newest with the same sources: later
    commits of docs and results leave SUMMARY.md as it was. (Run m of 2026-12-02 ran c3924dd's sources, which
    the commits after it, docs and results only, kept.)"""
    from tpweave.bench.provenance import commit_of_sources

    found = commit_of_sources("20dc4a7e16ba30a0")
    if found is None:
        pytest.skip("this checkout's last 300 commits do not hold c3924dd")
    assert found.startswith("c3924dd")
