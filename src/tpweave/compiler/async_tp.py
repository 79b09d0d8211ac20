"""Async-TP pass: all_gather_tokens -> matmul(s) and matmul -> reduce_scatter_tokens become one
strategy-dispatched op each (`tpweave::ag_mm` / `ag_scaled_mm`, `tpweave::mm_rs` / `scaled_mm_rs`),
whose strategy is picked per M at run time (ops/dispatched_ops.py).

Matching follows torch's micro_pipeline_tp: one small dataclass per matched pattern (`_Matmul`,
`_GatherMatch`, `_ReduceScatterMatch`), found first, then rewritten. bf16 and FP8 go through the same
path: an FP8 matmul is `tpweave::scaled_mm` whose rows and row scales come from two gathers of the
same tokens, fused together.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from tpweave.compiler.graph_utils import VIEW_OPS, GraphEditor, aten, same_sizes, tpw, val
from tpweave.compiler.report import GraphReport

_WEIGHT_VIEWS = (aten.permute.default, aten.t.default, *VIEW_OPS)
PolicyFor = Callable[[str, int, int], str]  # (kind, K, N) -> policy string


@dataclass
class _Matmul:
    """One matmul that reads a gathered activation A (as (N, K)):
    mm(A, W) with W (K, N_i); addmm(b, A, W); or FP8 scaled_mm(A, W, A_scale, w_scale, b, dtype), W (N_i, K)."""

    node: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    view: fx.Node | None  # the 2-D view of a (B, S, K) gather that the matmul reads, else None
    w_scale: fx.Node | None = None  # FP8 only
    scale_gather: fx.Node | None = None  # FP8 only: the gather of A's row scales

    @property
    def width(self) -> int:
        """N_i, the matmul's output columns."""
        return int(val(self.weight).shape[0 if self.scale_gather is not None else 1])

    @property
    def operands(self) -> list[fx.Node]:
        """The inputs besides A that the fused op needs before its first matmul."""
        return [a for a in (self.weight, self.bias, self.w_scale) if isinstance(a, fx.Node)]


@dataclass
class _GatherMatch:
    """Gathers of one tensor's token shards and the matmuls that read them (all of them together):
    gathers = (ag,) for bf16/fp32, (ag_rows, ag_row_scales) for FP8."""

    gathers: tuple[fx.Node, ...]
    matmuls: list[_Matmul]

    @property
    def fp8(self) -> bool:
        return len(self.gathers) == 2

    @property
    def kind(self) -> str:
        return "ag_scaled_mm" if self.fp8 else "ag_mm"

    def fused_args(self, policy: str) -> tuple:
        """Arguments of tpweave::ag_mm / ag_scaled_mm, need_gathered=True until the rewrite knows better."""
        ms = self.matmuls
        _, token_sizes, group_name, world_size = self.gathers[0].args
        locals_ = tuple(g.args[0] for g in self.gathers)
        if not self.fp8:
            return (
                *locals_,
                [m.weight for m in ms],
                [m.bias for m in ms],
                token_sizes,
                group_name,
                world_size,
                policy,
                True,
            )
        weights, scales, biases = [m.weight for m in ms], [m.w_scale for m in ms], [m.bias for m in ms]
        out_dtype = ms[0].node.args[5]
        return (*locals_, weights, scales, biases, token_sizes, group_name, world_size, out_dtype, policy, True)


@dataclass
class _ReduceScatterMatch:
    """reduce_scatter_tokens(mm(a, w)) (optionally through one view), or FP8
    reduce_scatter_tokens(scaled_mm(a, w, a_scale, w_scale, None, dtype))."""

    reduce_scatter: fx.Node
    matmul: fx.Node
    view: fx.Node | None

    @property
    def fp8(self) -> bool:
        return self.matmul.target is tpw.scaled_mm.default


def _matmuls_of(ag: fx.Node) -> list[_Matmul]:
    """Every matmul that reads the gathered tensor, directly or through a 2-D view (a (B, S, K) gather)."""
    found = []
    k = val(ag).shape[-1]

    def scan(a_node: fx.Node, view: fx.Node | None) -> None:
        for u in a_node.users:
            if u.target is aten.mm.default and u.args[0] is a_node:
                found.append(_Matmul(u, u.args[1], None, view))
            elif u.target is aten.addmm.default and u.args[1] is a_node and not u.kwargs:
                found.append(_Matmul(u, u.args[2], u.args[0], view))
            elif u.target is tpw.scaled_mm.default and u.args[0] is a_node and view is None:
                scale = u.args[2]
                if isinstance(scale, fx.Node) and scale.target is ag.target and scale.args[1:] == ag.args[1:]:
                    found.append(_Matmul(u, u.args[1], u.args[4], None, w_scale=u.args[3], scale_gather=scale))

    if val(ag).dim() == 2:
        scan(ag, None)
    for u in ag.users:
        if u.target in VIEW_OPS and val(u).dim() == 2 and val(u).shape[-1] == k and val(ag).dim() > 2:
            scan(u, u)
    return found


def _hoist(node: fx.Node, before: fx.Node, order: dict[fx.Node, float]) -> bool:
    """Make `node` (a view chain of a graph input) available before `before`; False if it cannot be."""
    if order[node] < order[before]:
        return True
    if node.target not in _WEIGHT_VIEWS or len(node.all_input_nodes) != 1:
        return False
    if not _hoist(node.all_input_nodes[0], before, order):
        return False
    before.prepend(node)
    order[node] = order[before] - 0.5
    return True


def _readers_between(gathered: list[fx.Node], stop: fx.Node, order: dict[fx.Node, float]) -> list[fx.Node]:
    """Nodes after the gathers and before `stop` that read them, directly or not: kept readers (a view a
    non-matmul also reads) must move after the fused op, whose outputs replace the gathers."""
    found, tainted = [], set(gathered)
    node = min(gathered, key=order.__getitem__).next
    while node is not stop:
        if tainted & set(node.all_input_nodes):
            found.append(node)
            tainted.add(node)
        node = node.next
    return found


def _sink(nodes: list[fx.Node], *, after: fx.Node, erased: set[fx.Node]) -> None:
    """Move `nodes` (in their order) after `after` and the getitems that directly follow it."""
    while after.next.target is operator.getitem and after.next.args[0] is after.args[0]:
        after = after.next
    for n in nodes:
        if n not in erased:
            after.append(n)
            after = n


def _gather_matches(graph: fx.Graph, report: GraphReport) -> list[_GatherMatch]:
    """One match per gathered tensor (FP8: per pair of rows and row-scales gathers) with a matmul reader;
    every other gather is reported as left alone."""
    matches: dict[tuple[fx.Node, ...], list[_Matmul]] = {}
    gathers = [n for n in graph.nodes if n.target is tpw.all_gather_tokens.default]
    for ag in gathers:
        if val(ag.args[0]).dim() != 2:
            report.add("all_gather", ag, "left alone", "shard is not (rows, K)")
            continue
        for mm in _matmuls_of(ag):
            key = (ag,) if mm.scale_gather is None else (ag, mm.scale_gather)
            matches.setdefault(key, []).append(mm)
    in_a_match = {g for key in matches for g in key}
    for ag in gathers:
        if ag not in in_a_match and val(ag.args[0]).dim() == 2:
            report.add("all_gather", ag, "left alone", "no matmul consumer: " + ", ".join(u.name for u in ag.users))
    mixed = {g for key in matches for g in key if sum(g in other for other in matches) > 1}
    for key in [key for key in matches if set(key) & mixed]:
        report.add("all_gather", key[0], "left alone", "read by matmuls of different kinds (bf16 and FP8)")
        del matches[key]
    return [_GatherMatch(key, mms) for key, mms in matches.items()]


def fuse_all_gather_matmuls(graph: fx.Graph, *, policy_for: PolicyFor, report: GraphReport) -> None:
    """all_gather_tokens -> matmul(s) becomes one tpweave::ag_mm (FP8: two gathers -> ag_scaled_mm),
    placed before the first matmul; all matmuls of one gathered tensor share it (q/k/v, gate/up):

        before:  a = all_gather_tokens(x_local, [M], group, TP)      after:  r = ag_mm(x_local, [w_q, w_k], [None, b_k],
                 q = mm(a, w_q)                                                          [M], group, TP, policy, need)
                 ...                                                          q = r[1]
                 k = addmm(b_k, a, w_k)                                       k = r[2]
                 y = other(a)                                                  y = other(r[0])   (moved after r)

    Weights defined after the first matmul (views of graph inputs) are hoisted before it; a matmul whose
    weight cannot be hoisted keeps the plain gather. Readers of the gather between the gather and the
    fused op (a kept view) move after it. need_gathered=False when nothing but the matmuls reads A.
    """
    edit = GraphEditor(graph)
    for match in _gather_matches(graph, report):
        order = {n: float(i) for i, n in enumerate(graph.nodes)}
        match.matmuls.sort(key=lambda m: order[m.node])
        first = match.matmuls[0].node
        match.matmuls = [m for m in match.matmuls if all(_hoist(a, first, order) for a in m.operands)]
        if not match.matmuls:
            report.add("all_gather", match.gathers[0], "left alone", "its matmuls' weights are defined after them")
            continue
        first = match.matmuls[0].node
        k = int(val(match.gathers[0]).shape[-1])
        policy = policy_for(match.kind, k, sum(m.width for m in match.matmuls))
        target = tpw.ag_scaled_mm.default if match.fp8 else tpw.ag_mm.default
        fused = edit.insert(target, match.fused_args(policy), before=first)
        _replace_gather_and_matmuls(graph, match, fused, order)
        names = ", ".join(m.node.name for m in match.matmuls)
        what = f"{len(match.matmuls)} {'FP8 ' if match.fp8 else ''}matmul(s) [{names}], policy {policy!r}"
        report.add(
            "all_gather+scaled_matmul" if match.fp8 else "all_gather+matmul",
            fused,
            "fused",
            f"tpweave::{match.kind} over {what}",
        )


def _replace_gather_and_matmuls(graph: fx.Graph, match: _GatherMatch, fused: fx.Node, order: dict) -> None:
    """Make the graph read `fused`'s outputs ([gathered..., matmul outputs...]) and drop what it replaced."""
    num_gathered = len(match.gathers)
    readers = _readers_between(list(match.gathers), fused, order)
    with graph.inserting_after(fused):
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(num_gathered + len(match.matmuls))]
    for i, o in enumerate(outs):
        o.meta["val"] = val(fused)[i]
    erased = set()
    for mm, out in zip(match.matmuls, outs[num_gathered:]):
        mm.node.replace_all_uses_with(out)
        graph.erase_node(mm.node)
        if mm.view is not None and not mm.view.users and mm.view not in erased:
            graph.erase_node(mm.view)
            erased.add(mm.view)
    for gather, out in zip(match.gathers, outs):
        gather.replace_all_uses_with(out)
        graph.erase_node(gather)
    _sink(readers, after=outs[0], erased=erased)
    if not any(o.users for o in outs[:num_gathered]):
        fused.update_arg(len(fused.args) - 1, False)  # need_gathered: nothing reads A (or its scales)
    for o in outs:
        if not o.users:
            graph.erase_node(o)


def _reduce_scatter_matches(graph: fx.Graph, report: GraphReport) -> list[_ReduceScatterMatch]:
    found = []
    for rs in [n for n in graph.nodes if n.target is tpw.reduce_scatter_tokens.default]:
        src, view = rs.args[0], None
        if src.target in VIEW_OPS and len(src.users) == 1:
            src, view = src.args[0], src
        fp8 = src.target is tpw.scaled_mm.default and src.args[4] is None  # FP8 without bias
        if not (src.target is aten.mm.default or fp8) or len(src.users) != 1:
            report.add("reduce_scatter", rs, "left alone", "its input is not a matmul used only here")
            continue
        found.append(_ReduceScatterMatch(rs, src, view))
    return found


def fuse_matmul_reduce_scatters(graph: fx.Graph, *, policy_for: PolicyFor, report: GraphReport) -> None:
    """matmul -> reduce_scatter_tokens becomes one tpweave::mm_rs (FP8: scaled_mm_rs):

        before:  p = mm(a, w)                                  after:  s = mm_rs(a, w, group, TP, policy)
                 s = reduce_scatter_tokens(p, 1, group, TP)

        FP8:     p = scaled_mm(a, w, a_scale, w_scale, None, dt)        s = scaled_mm_rs(a, a_scale, w, w_scale,
                 s = reduce_scatter_tokens(p, 1, group, TP)                                group, TP, dt, policy)

    A view between the matmul and the scatter is absorbed when the fused op's rows match the scatter's.
    """
    edit = GraphEditor(graph)
    for match in _reduce_scatter_matches(graph, report):
        rs, mm = match.reduce_scatter, match.matmul
        _, _, group_name, world_size = rs.args
        if match.fp8:
            a, w, a_scale, w_scale, _, out_dtype = mm.args
            policy = policy_for("scaled_mm_rs", int(val(w).shape[1]), int(val(w).shape[0]))
            args = (a, a_scale, w, w_scale, group_name, world_size, out_dtype, policy)
            fused = edit.insert(tpw.scaled_mm_rs.default, args, before=rs)
        else:
            a, w = mm.args
            policy = policy_for("mm_rs", int(val(w).shape[0]), int(val(w).shape[1]))
            fused = edit.insert(tpw.mm_rs.default, (a, w, group_name, world_size, policy), before=rs)
        if not same_sizes(val(fused).shape, val(rs).shape):
            graph.erase_node(fused)
            report.add("reduce_scatter", rs, "left alone", "matmul rows do not match the scattered tokens")
            continue
        rs.replace_all_uses_with(fused)
        for n in (rs, match.view, mm):
            if n is not None and not n.users:
                graph.erase_node(n)
        op = "scaled_mm_rs" if match.fp8 else "mm_rs"
        report.add("matmul+reduce_scatter", fused, "fused", f"tpweave::{op}, policy {policy!r}")
