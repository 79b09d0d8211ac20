"""What the passes did to one compiled graph, and why they left a site alone."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Site:
    """One collective site of a graph: its kind, node name, shape and dtype of the communicated tensor, what
    the passes made of it and why; row_bytes is the bytes per token row when static, else None."""

    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "gather_before_unknown_op", ...
    node: str  # node name in the post-grad graph
    shape: str
    action: str  # what it became: "sequence-parallel", "fused", "left alone", ...
    reason: str = ""
    dtype: str = ""  # of the communicated tensor
    row_bytes: int | None = None  # bytes per token row (all but the leading dim), when static

    def __str__(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.kind:<24} {self.node:<28} {self.shape + ' ' + self.dtype:<30} -> {self.action}{why}"


@dataclass
class GraphReport:
    """What the passes did to one compiled graph of a variant ("sp" or "plain"): its sites, notes, and the
    graph's collectives per kind before and after the passes."""

    variant: str
    serves: str = ""  # the token counts this graph serves, in words ("M = 1", "M >= 2048", ...)
    sites: list[Site] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts_before: dict[str, int] = field(default_factory=dict)
    counts_after: dict[str, int] = field(default_factory=dict)
    # (op kind, policy) of every strategy-dispatched op in the compiled graph, in graph order
    dispatched: list[tuple[str, str]] = field(default_factory=list)
    # token split: the matmuls, all-reduce starts and waits in graph order, each with its subset ("mm A", ...)
    schedule: list[str] = field(default_factory=list)
    # decode GEMV (compiler/decode_gemv.py): linear layers routed through tpweave::linear, and how many of them read
    # the gated MLP's silu(gate) * up themselves
    linears: int = 0
    gated_linears: int = 0
    norm_linears: int = 0  # ... and of them, how many also take the residual add + RMSNorm before them
    # invariant="batch" (compiler/invariant.py): {"swapped": {op: count}, "not_invariant": {op: count}}; None when off
    invariant: dict | None = None

    def add(self, kind: str, node, action: str, reason: str = "") -> Site:
        """Record what became of the collective at `node` (shape, dtype and bytes per token row read from its fake
        value); the new Site."""
        val = node.meta.get("val") if hasattr(node, "meta") else None
        shape = tuple(val.shape) if hasattr(val, "shape") else ()
        dtype = str(val.dtype).removeprefix("torch.") if hasattr(val, "dtype") else ""
        row_bytes = None
        if len(shape) >= 1 and all(isinstance(d, int) for d in shape[1:]):
            row_bytes = math.prod(shape[1:]) * val.dtype.itemsize
        site = Site(
            kind, getattr(node, "name", str(node)), str(shape).replace(" ", ""), action, reason, dtype, row_bytes
        )
        self.sites.append(site)
        return site

    @property
    def gathered_bytes_per_token(self) -> int:
        """Bytes every token moves through the all-gathers the SP pass inserted (per forward)."""
        return sum(s.row_bytes or 0 for s in self.sites if s.kind == "all_gather" and s.action == "inserted")

    def to_dict(self) -> dict:
        """JSON-ready: variant, counts, dispatched ops, sites and notes."""
        return {
            "variant": self.variant,
            "serves": self.serves,
            "counts_before": self.counts_before,
            "counts_after": self.counts_after,
            "dispatched": [list(d) for d in self.dispatched],
            "sites": [dataclasses.asdict(s) for s in self.sites],
            "notes": list(self.notes),
            "schedule": list(self.schedule),
            "linears": self.linears,
            "gated_linears": self.gated_linears,
            "norm_linears": self.norm_linears,
            "invariant": self.invariant,
        }

    def __str__(self) -> str:
        serves = f" serves {self.serves};" if self.serves else ""
        lines = [f"[{self.variant}]{serves} collectives before: {self.counts_before}  after: {self.counts_after}"]
        if self.gathered_bytes_per_token:
            lines.append(f"  all-gathered bytes per token: {self.gathered_bytes_per_token}")
        lines += [f"  {s}" for s in self.sites]
        if self.linears:
            lines.append(
                f"  decode GEMV: {self.linears} linear layers ({self.gated_linears} reading silu(gate) * up, "
                f"{self.norm_linears} taking the residual add + RMSNorm before them)"
            )
        if self.invariant is not None:
            swapped = ", ".join(f"{op} x{c}" for op, c in sorted(self.invariant["swapped"].items())) or "nothing"
            lines.append(f"  batch-invariant kernels swapped in for: {swapped}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class CompileReport:
    """Everything `tpweave.report(compiled)` shows: one GraphReport per compiled variant."""

    graphs: list[GraphReport] = field(default_factory=list)
    num_compiles: int = 0
    sp_min_tokens: int | None = None
    table: str = ""  # which calibration table the policies come from, in words
    notes: list[str] = field(default_factory=list)  # about the whole model, e.g. nothing was compiled
    recompile_limit_hit_in: list[str] = field(default_factory=list)  # functions Dynamo stopped compiling

    def to_dict(self) -> dict:
        """JSON-ready: every graph's report, notes, the SP boundary, the table, recompile limits reached."""
        return {
            "num_compiles": self.num_compiles,
            "sp_min_tokens": self.sp_min_tokens,
            "table": self.table,
            "notes": list(self.notes),
            "recompile_limit_hit_in": list(self.recompile_limit_hit_in),
            "graphs": [g.to_dict() for g in self.graphs],
        }

    def fallbacks(self) -> list[str]:
        """Everything that makes this model run other than as compiled by tpweave: a pass or Inductor
        failure, no graph traced, graph breaks, a reached recompile limit (the notes that say so)."""
        words = ("failed", "runs eagerly", "uncompiled", "recompile limit", "graph breaks")
        notes = [*self.notes, *(n for g in self.graphs for n in g.notes)]
        return [n for n in notes if any(w in n for w in words)]

    def headline(self) -> str:
        """'tpweave report: N graph(s) compiled; ...which graph serves which M; calibration table: ...'."""
        head = f"tpweave report: {self.num_compiles} graph(s) compiled"
        if self.sp_min_tokens == 0:
            head += "; the sequence-parallel graph serves every M"
        elif self.sp_min_tokens is not None:
            head += f"; sequence-parallel graph for M >= {self.sp_min_tokens}, plain TP graph below"
        if self.table:
            head += f"\ncalibration table: {self.table}"
        return head

    def summary(self) -> str:
        """A few lines: per compiled graph, how many sites of each kind became what (with the reasons of
        those left alone), then the notes."""
        lines = [self.headline()]
        for i, g in enumerate(self.graphs, 1):
            counts = Counter((s.kind, s.action) for s in g.sites)
            done = ", ".join(f"{n} {kind} {action}" for (kind, action), n in sorted(counts.items()))
            serves = f" ({g.serves})" if g.serves else ""
            lines.append(f"graph {i} [{g.variant}]{serves}: {done or 'no collective site'}")
            reasons = Counter(f"{s.kind}: {s.reason}" for s in g.sites if s.action == "left alone")
            lines += [f"  left alone x{n}: {why}" for why, n in sorted(reasons.items())]
            lines += [f"  note: {n}" for n in g.notes]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join([self.headline(), *(f"note: {n}" for n in self.notes), *(str(g) for g in self.graphs)])
