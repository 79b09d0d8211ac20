"""Async-TP pass: all_gather_tokens -> matmul(s) and matmul -> reduce_scatter_tokens become one
tpweave overlapped op each (`tpweave::ag_mm`, `tpweave::mm_rs`), whose strategy is picked per M at run time."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch.fx as fx

from tpweave.compiler.graph_utils import VIEW_OPS, GraphEditor, aten, same_sizes, tpw, val
from tpweave.compiler.report import GraphReport

_WEIGHT_VIEWS = (aten.permute.default, aten.t.default, *VIEW_OPS)


def _matmul_users(ag: fx.Node) -> list[tuple[fx.Node, fx.Node, fx.Node | None, fx.Node | None]]:
    """(matmul node, weight, bias, 2-D view of ag it reads or None) for every matmul fed by the gather."""
    found = []
    k = val(ag).shape[-1]

    def scan(a_node: fx.Node, view: fx.Node | None) -> None:
        for u in a_node.users:
            if u.target is aten.mm.default and u.args[0] is a_node:
                found.append((u, u.args[1], None, view))
            elif u.target is aten.addmm.default and u.args[1] is a_node and not u.kwargs:
                found.append((u, u.args[2], u.args[0], view))

    if val(ag).dim() == 2:
        scan(ag, None)
    for u in ag.users:
        if u.target in VIEW_OPS and val(u).dim() == 2 and val(u).shape[-1] == k and val(ag).dim() > 2:
            scan(u, u)
    return found


def _hoist(weight: fx.Node, before: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Make `weight` (a view chain of a graph input) available before `before`; False if it cannot be."""
    if order[weight] < order[before]:
        return True
    if weight.target not in _WEIGHT_VIEWS or len(weight.all_input_nodes) != 1:
        return False
    if not _hoist(weight.all_input_nodes[0], before, order):
        return False
    before.prepend(weight)
    order[weight] = order[before] - 0.5
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


def fuse_all_gather_matmuls(
    graph: fx.Graph, *, policy_for: Callable[[str, int, int], str], report: GraphReport
) -> None:
    edit = GraphEditor(graph)
    for ag in [n for n in graph.nodes if n.target is tpw.all_gather_tokens.default]:
        x_local, token_sizes, group_name, world_size = ag.args
        if val(x_local).dim() != 2:
            report.add("all_gather", ag, "left alone", "shard is not (rows, K)")
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        users = sorted(_matmul_users(ag), key=lambda u: order[u[0]])
        if not users:
            report.add("all_gather", ag, "left alone", "no matmul consumer: " + ", ".join(u.name for u in ag.users))
            continue
        first = users[0][0]
        users = [u for u in users if _hoist(u[1], first, order) and (u[2] is None or _hoist(u[2], first, order))]
        # One GEMM width for the site: the sum over the matmuls sharing this gather.
        policy = policy_for("ag_mm", int(val(x_local).shape[-1]), sum(int(val(u[1]).shape[1]) for u in users))
        args = (
            x_local,
            [u[1] for u in users],
            [u[2] for u in users],
            token_sizes,
            group_name,
            world_size,
            policy,
            True,
        )
        fused = edit.insert(tpw.ag_mm.default, args, before=first)
        readers = _readers_between([ag], fused, order)
        with graph.inserting_after(fused):
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(users) + 1)]
        for i, o in enumerate(outs):
            o.meta["val"] = val(fused)[i]
        erased = set()
        for i, (mm, _, _, view) in enumerate(users, start=1):
            mm.replace_all_uses_with(outs[i])
            graph.erase_node(mm)
            if view is not None and not view.users:
                graph.erase_node(view)
                erased.add(view)
        ag.replace_all_uses_with(outs[0])
        graph.erase_node(ag)
        _sink(readers, after=outs[0], erased=erased)
        if not outs[0].users:
            fused.update_arg(len(args) - 1, False)  # need_gathered: nothing reads A
        for o in outs:
            if not o.users:
                graph.erase_node(o)
        names = ", ".join(u[0].name for u in users)
        report.add(
            "all_gather+matmul",
            fused,
            "fused",
            f"tpweave::ag_mm over {len(users)} matmul(s) [{names}], policy {policy!r}",
        )


def fuse_all_gather_scaled_matmuls(
    graph: fx.Graph, *, policy_for: Callable[[str, int, int], str], report: GraphReport
) -> None:
    """FP8: gather(x_fp8) and gather(x_scale) feeding tpweave::scaled_mm(s) -> one tpweave::ag_scaled_mm."""
    edit = GraphEditor(graph)
    groups: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
    for mm in [n for n in graph.nodes if n.target is tpw.scaled_mm.default]:
        x, _, scale = mm.args[:3]
        gathers = (x, scale)
        if (
            all(isinstance(g, fx.Node) and g.target is tpw.all_gather_tokens.default for g in gathers)
            and x.args[1:] == scale.args[1:]
        ):
            groups.setdefault(gathers, []).append(mm)
    for (ag_x, ag_s), mms in groups.items():
        order = {n: i for i, n in enumerate(graph.nodes)}
        mms.sort(key=lambda n: order[n])
        first = mms[0]
        mms = [
            mm for mm in mms if all(a is None or _hoist(a, first, order) for a in (mm.args[1], mm.args[3], mm.args[4]))
        ]
        if not mms or val(ag_x.args[0]).dim() != 2:
            report.add("all_gather", ag_x, "left alone", "FP8 shard is not (rows, K) or its weights come later")
            continue
        _, token_sizes, group_name, world_size = ag_x.args
        policy = policy_for("ag_scaled_mm", int(val(ag_x).shape[-1]), sum(int(val(mm.args[1]).shape[0]) for mm in mms))
        args = (
            ag_x.args[0],
            ag_s.args[0],
            [mm.args[1] for mm in mms],
            [mm.args[3] for mm in mms],
            [mm.args[4] for mm in mms],
            token_sizes,
            group_name,
            world_size,
            mms[0].args[5],
            policy,
            True,
        )
        fused = edit.insert(tpw.ag_scaled_mm.default, args, before=first)
        readers = _readers_between([ag_x, ag_s], fused, order)
        with graph.inserting_after(fused):
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(mms) + 2)]
        for i, o in enumerate(outs):
            o.meta["val"] = val(fused)[i]
        for i, mm in enumerate(mms, start=2):
            mm.replace_all_uses_with(outs[i])
            graph.erase_node(mm)
        for g, o in ((ag_x, outs[0]), (ag_s, outs[1])):
            g.replace_all_uses_with(o)
            graph.erase_node(g)
        _sink(readers, after=outs[0], erased=set())
        if not outs[0].users and not outs[1].users:
            fused.update_arg(len(args) - 1, False)  # need_gathered: nothing reads A or its scales
        for o in outs:
            if not o.users:
                graph.erase_node(o)
        names = ", ".join(mm.name for mm in mms)
        report.add(
            "all_gather+scaled_matmul",
            fused,
            "fused",
            f"tpweave::ag_scaled_mm over {len(mms)} FP8 matmul(s) [{names}], policy {policy!r}",
        )


def fuse_matmul_reduce_scatters(
    graph: fx.Graph, *, policy_for: Callable[[str, int, int], str], report: GraphReport
) -> None:
    edit = GraphEditor(graph)
    for rs in [n for n in graph.nodes if n.target is tpw.reduce_scatter_tokens.default]:
        x, _, group_name, world_size = rs.args
        src, view = x, None
        if src.target in VIEW_OPS and len(src.users) == 1:
            src, view = src.args[0], src
        scaled = src.target is tpw.scaled_mm.default and src.args[4] is None  # FP8, no bias
        if not (src.target is aten.mm.default or scaled) or len(src.users) != 1:
            report.add("reduce_scatter", rs, "left alone", f"input {x.name} is not a matmul used only here")
            continue
        if scaled:
            a, w, a_scale, w_scale, _, out_dtype = src.args
            policy = policy_for("scaled_mm_rs", int(val(w).shape[1]), int(val(w).shape[0]))
            fused = edit.insert(
                tpw.scaled_mm_rs.default, (a, a_scale, w, w_scale, group_name, world_size, out_dtype, policy), before=rs
            )
        else:
            a, w = src.args
            policy = policy_for("mm_rs", int(val(w).shape[0]), int(val(w).shape[1]))
            fused = edit.insert(tpw.mm_rs.default, (a, w, group_name, world_size, policy), before=rs)
        if not same_sizes(val(fused).shape, val(rs).shape):
            graph.erase_node(fused)
            report.add("reduce_scatter", rs, "left alone", "matmul rows do not match the scattered tokens")
            continue
        rs.replace_all_uses_with(fused)
        for n in (rs, view, src):
            if n is not None and not n.users:
                graph.erase_node(n)
        report.add(
            "matmul+reduce_scatter",
            fused,
            "fused",
            f"tpweave::{'scaled_mm_rs' if scaled else 'mm_rs'}, policy {policy!r}",
        )
