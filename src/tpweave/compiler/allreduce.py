"""Plain-TP graph: route each TP all-reduce through `tpweave::all_reduce`, whose strategy (NCCL, or
symmetric-memory one-shot / two-shot) is picked per M from the calibrated table."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from tpweave.compiler.graph_utils import GraphEditor, all_reduce_waits, tpw, val
from tpweave.compiler.report import GraphReport
from tpweave.compiler.sequence_parallel import SPConfig


def route_all_reduces(graph: fx.Graph, cfg: SPConfig, *, policy_for: Callable[[str, int, int], str], report: GraphReport) -> None:
    edit = GraphEditor(graph)
    for wait, ar in all_reduce_waits(graph):
        x, reduce_op, group_name = ar.args[:3]
        hidden = val(x).shape[-1] if val(x).dim() else 1
        policy = policy_for("all_reduce", hidden, hidden) if isinstance(hidden, int) else "sequential"
        if reduce_op != "sum" or group_name != cfg.group_name or len(ar.users) != 1 or policy == "sequential":
            report.add("all_reduce", ar, "left alone", "plain TP variant" + ("" if policy == "sequential" else f"; cannot route ({reduce_op}, {group_name})"))
            continue
        report.add("all_reduce", ar, "routed", f"tpweave::all_reduce, policy {policy!r}")
        routed = edit.insert(tpw.all_reduce.default, (x, group_name, cfg.world_size, policy), before=wait)
        wait.replace_all_uses_with(routed)
        graph.erase_node(wait)
        graph.erase_node(ar)
