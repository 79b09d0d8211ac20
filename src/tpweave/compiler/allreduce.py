"""Plain-TP graph: route each TP all-reduce through `tpweave::all_reduce`, whose strategy (NCCL, or
symmetric-memory one-shot / two-shot) is picked per M from the calibrated table. One left to
Inductor gets its token dims flattened first (see `_flatten_tokens`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from tpweave.compiler.graph_utils import GraphEditor, all_reduce_waits, aten, funcol, tpw, val
from tpweave.compiler.invariant import read_sizes_elsewhere, row_parallel_product
from tpweave.compiler.report import GraphReport
from tpweave.compiler.tp_group import TPGroup


def route_all_reduces(
    graph: fx.Graph, cfg: TPGroup, *, policy_for: Callable[[str, int, int], str], report: GraphReport
) -> None:
    """Replace each sum all-reduce over the TP group (with one user) by tpweave::all_reduce under the policy
    `policy_for` gives it at this hidden size; the others, and those whose policy is "sequential", stay the
    process group's all-reduces (token dims flattened where possible). Every decision is added to `report`."""
    edit = GraphEditor(graph)
    for wait, ar in all_reduce_waits(graph):
        x, reduce_op, group_name = ar.args[:3]
        hidden = val(x).shape[-1] if val(x).dim() else 1
        policy = policy_for("all_reduce", hidden, hidden) if isinstance(hidden, int) else "sequential"
        if reduce_op != "sum" or group_name != cfg.group_name or len(ar.users) != 1 or policy == "sequential":
            why = "plain TP variant" + ("" if policy == "sequential" else f"; cannot route ({reduce_op}, {group_name})")
            if len(ar.users) == 1 and _flatten_tokens(edit, wait, ar):
                why += "; token dims flattened"
            report.add("all_reduce", ar, "left alone", why)
            continue
        report.add("all_reduce", ar, "routed", f"tpweave::all_reduce, policy {policy!r}")
        routed = edit.insert(tpw.all_reduce.default, (x, group_name, cfg.world_size, policy), before=wait)
        wait.replace_all_uses_with(routed)
        graph.erase_node(wait)
        graph.erase_node(ar)


def order_all_reduces(
    graph: fx.Graph, cfg: TPGroup, *, report: GraphReport, level: str = "batch"
) -> dict[fx.Node, fx.Node]:
    """Invariant mode, token-split graph: each sum all-reduce over the TP group becomes an all-gather, issued where the
    all-reduce was (so it stays in flight under the other token subset's matmuls), and, where the all-reduce was
    waited for, the ranks' parts summed in rank order (tpweave::ordered_sum_gathered: for every element the bits the
    plain graph's "ordered" all-reduce gives it). The others stay the backend's (in the report).

        ar = all_reduce(x, "sum", g)                    ag = all_gather_into_tensor(x, W, g)
        ... (the other subset's matmuls) ...     ->     ...
        r = wait_tensor(ar)                             r = ordered_sum_gathered(wait_tensor(ag), W)

    level "tp": a row-parallel product's all-reduce gathers each rank's fp32 subtree of the product, summed in the
    tree of the TP=1 product (ops/invariant.py, K_CHUNKS); the bits of the plain graph's tp_invariant_mm_all_reduce.

        x = mm(a, b)                                    p = tp_invariant_rank_subtree(a, b, W)   (fp32)
        ar = all_reduce(x, "sum", g)             ->     ag = all_gather_into_tensor(p, W, g)
        ...                                             ...
        r = wait_tensor(ar)                             r = ordered_sum_gathered(wait_tensor(ag), W, x.dtype)

    Returns {new node: the node it stands for}: each all-gather for its all-reduce, each new wait for the old one, each
    subtree for its matmul."""
    edit = GraphEditor(graph)
    replaced: dict[fx.Node, fx.Node] = {}
    for wait, ar in all_reduce_waits(graph):
        x, reduce_op, group_name = ar.args[:3]
        if reduce_op != "sum" or group_name != cfg.group_name or len(ar.users) != 1:
            why = f"invariant token split: cannot order ({reduce_op}, {group_name})"
            report.add("all_reduce", ar, "left alone", why)
            continue
        found = row_parallel_product(x) if level == "tp" else None
        dtype = chain = None
        if found is not None:
            report.add("all_reduce", ar, "routed", "ordered: the ranks' fp32 product subtrees all-gathered where it "
                       "was issued, summed in the TP=1 product's tree")  # fmt: skip
            product, chain = found
            read_sizes_elsewhere(edit, product)
            dtype = val(product).dtype
            x = edit.insert(tpw.tp_invariant_rank_subtree.default, (*product.args[:2], cfg.world_size), before=ar)
            replaced[x] = product
        else:
            report.add("all_reduce", ar, "routed", "ordered: all-gathered where it was issued, summed in rank order")
        gathering = edit.insert(funcol.all_gather_into_tensor.default, (x, cfg.world_size, group_name), before=ar)
        gathered = edit.insert(funcol.wait_tensor.default, (gathering,), before=wait)
        summed = edit.insert(tpw.ordered_sum_gathered.default, (gathered, cfg.world_size, dtype), before=wait)
        if chain:
            summed = edit.insert(aten.reshape.default, (summed, chain[-1].args[1]), before=wait)
        wait.replace_all_uses_with(summed)
        graph.erase_node(wait)
        graph.erase_node(ar)
        if found is not None:
            edit.erase_unused({product, *chain})
        replaced[gathering], replaced[gathered] = ar, wait
    return replaced


def _flatten_tokens(edit: GraphEditor, wait: fx.Node, ar: fx.Node) -> bool:
    """all_reduce(x_BSH) -> all_reduce(x.reshape(-1, H)).view(B, S, H). Lowering Inductor's all-reduce
    of a 3-D view makes it guard on the view's sizes (seq >= 2: more graphs); on the (tokens, H) matrix
    there is nothing to guard. False (graph unchanged) for 2-D inputs."""
    x = ar.args[0]
    if not (isinstance(val(x), torch.Tensor) and val(x).dim() >= 3):
        return False
    sizes = [edit.size_arg(x, d, before=wait) for d in range(val(x).dim())]
    flat = edit.insert(aten.reshape.default, (x, [-1, sizes[-1]]), before=wait)
    reducing = edit.insert(funcol.all_reduce.default, (flat, *ar.args[1:]), before=wait)
    reduced = edit.insert(funcol.wait_tensor.default, (reducing,), before=wait)
    back = edit.insert(aten.view.default, (reduced, sizes), before=wait)
    wait.replace_all_uses_with(back)
    edit.graph.erase_node(wait)
    edit.graph.erase_node(ar)
    return True
