"""Numbers in the docs come from committed results, never typed: quoted with their source (tests/doc_quotes.py),
or, in the results README's older entries, found as a whole number in the generated summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpweave.bench.provenance import code_version
from tpweave.bench.results import load_results, summary

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "benchmarks" / "results" / "SUMMARY.md"
QUOTING = [ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md", ROOT / "docs" / "status.md"]
# Documents whose every measured number (a decimal ratio, a percentage) is quoted from its result file: README.md,
# every docs/*.md and the results README
QUOTED_EXACTLY = [
    ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"
]  # fmt: skip
# A ratio as the summary prints it: 0.5 .. 2.0 with 2-3 decimals, not part of a version (2.13.0) or a longer number,
# nor a time or size (0.70 ms)
RATIO = re.compile(r"(?<![\d.])([0-2]\.\d{2,3})(?![\d.])(?!\s*(?:ms|s|us|GB|MB|TFLOP|W|MHz)\b)")


def _without_commit_age(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("- taken at commit"))


def quoted_ratios_not_in(text: str, source: str) -> list[str]:
    """Ratio-like numbers of `text` (outside quote markers, which tests/doc_quotes.py checks) that `source` does not
    hold as a whole number ("1.10" is not in "1.101")."""
    from doc_quotes import GOAL, QUOTE

    found = [m for m in RATIO.findall(GOAL.sub("", QUOTE.sub("", text))) if 0.5 <= float(m) < 2.0]
    held = set(RATIO.findall(source))
    return sorted({m for m in found if m not in held})


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
    assert quoted_ratios_not_in("auto is 1.09x faster", source) == ["1.09"]  # a prefix of 1.096 is not 1.096


def test_every_measured_number_is_quoted_from_its_result():
    from doc_quotes import quote_problems

    for doc in QUOTED_EXACTLY:
        problems = quote_problems(doc.read_text(), str(doc.relative_to(ROOT)))
        assert not problems, "\n".join(problems)


def test_a_planted_wrong_number_fails_the_check():
    """A copy of the README with one quoted number changed, and with one quote's markers dropped: both fail."""
    from doc_quotes import QUOTE, quote_problems

    text = (ROOT / "README.md").read_text()
    first = next(QUOTE.finditer(text))
    value = first.group("text")
    wrong = text.replace(first.group(0), first.group(0).replace(f"-->{value}<", f"-->{value[:-2]}9{value[-1]}<"), 1)
    assert any("the source says" in p for p in quote_problems(wrong, "README copy")), value
    bare = text.replace(first.group(0), value, 1)
    assert any("tied to no result" in p for p in quote_problems(bare, "README copy"))
    missing = text.replace(first.group("file"), "2026-12-04/no-such-run.json", 1)
    assert any("cannot read the source" in p for p in quote_problems(missing, "README copy"))


def test_sources_map_to_the_commit_that_brought_them_in():
    """A result's sources name the commit that introduced them, not the newest with the same sources: later
    commits of docs and results leave SUMMARY.md as it was. (Run m of 2026-12-02 ran c3924dd's sources, which
    the commits after it, docs and results only, kept.)"""
    from tpweave.bench.provenance import commit_of_sources

    found = commit_of_sources("20dc4a7e16ba30a0")
    if found is None:
        pytest.skip("this checkout's last 300 commits do not hold c3924dd")
    assert found.startswith("c3924dd")
