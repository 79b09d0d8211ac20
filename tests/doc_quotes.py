"""Numbers in the docs tied to the committed results they come from, checked exactly.

A measured number is written between markers naming its source, invisible in rendered markdown:

    <!-- q 2026-12-04/engine-v.json engine_prefill,tokens=2048 single_over_graph -->1.017<!-- /q -->x

the result file (under benchmarks/results/), the row (`what` and key=value pairs that pick exactly one row; `meta` for
the run's metadata) and the field (a dotted path). The text between the markers must be the field's value rounded to
the decimals it shows (a trailing % shows the value times 100). A number that is not a measurement, a target from an
issue or a setting of the code, is written `<!-- goal -->75%<!-- /goal -->` or `<!-- set -->2%<!-- /set -->`. Every
other ratio (1.02x) or percentage outside code is an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
QUOTE = re.compile(r"<!-- q (?P<file>\S+) (?P<row>\S+) (?P<field>\S+) -->(?P<text>[^<]*)<!-- /q -->")
GOAL = re.compile(r"<!-- (goal|set) -->[^<]*<!-- /\1 -->")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# what reads as a measurement: a ratio with decimals (1.017x; not "2x H200") or a percentage (75.7%), except the
# confidence of an interval ("95% interval")
MEASURED = re.compile(r"(?<![\w.])(?:\d+\.\d+x\b|\d+(?:\.\d+)?%(?!\s+(?:interval|confidence|CI)))")


def _row(data: dict, spec: str, where: str) -> dict:
    if spec == "meta":
        return data["meta"]
    what, *pairs = spec.split(",")
    wanted = dict(p.split("=", 1) for p in pairs)
    rows = [r for r in data["rows"] if r.get("what") == what and all(str(r.get(k)) == v for k, v in wanted.items())]
    if len(rows) != 1:
        raise AssertionError(f"{where}: {spec} picks {len(rows)} rows, not one")
    return rows[0]


def quote_problems(text: str, name: str, results: Path = RESULTS) -> list[str]:
    """What is wrong with the quotes of a document's text: a value that is not its source's, a source that is
    missing, a measured-looking number outside any marker."""
    problems = []
    for m in QUOTE.finditer(text):
        where = f"{name}: {m.group(0)}"
        path = results / m.group("file")
        try:
            data = json.loads(path.read_text())
            value = _row(data, m.group("row"), where)
            for key in m.group("field").split("."):
                value = value[key]
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            problems.append(f"{where}: cannot read the source ({e})")
            continue
        shown = m.group("text").strip()
        number = shown.rstrip("%x")
        decimals = len(number.split(".")[1]) if "." in number else 0
        scale = 100 if shown.endswith("%") else 1
        try:
            if round(float(value) * scale, decimals) != float(number):
                problems.append(f"{where}: the source says {float(value) * scale:.{decimals + 2}f}")
        except ValueError:
            problems.append(f"{where}: {shown!r} is not a number")
    rest = GOAL.sub("", QUOTE.sub("", CODE.sub("", text)))
    problems += [f"{name}: {n!r} is tied to no result (quote markers) and is no goal" for n in MEASURED.findall(rest)]
    return problems
