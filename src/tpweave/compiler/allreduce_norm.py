"""Fuse a reduction -> (+ residual) -> RMSNorm into one op: in the plain-TP graph all-reduce ->
`tpweave::all_reduce_rms_norm`; in the SP graph matmul + reduce-scatter -> `tpweave::mm_rs_rms_norm`.

The RMSNorm is recognized from its post-grad ATen ops, in the forms models write it:
    h32 = float(h)                     (absent when h is fp32)
    n32 = h32 * rsqrt(mean(h32^2, -1, keepdim) + eps)   (pow(h32, 2) or h32 * h32; eps as add.Tensor or add.Scalar)
    y = weight * dtype(n32)            (Llama/HF: weight_in_fp32=False)
    y = dtype(n32 * weight32)          (Gemma-style (1 + w), F.rms_norm: weight_in_fp32=True)
where weight is any (H,) tensor (a parameter, or 1 + w computed in the graph). Anything else (a
LayerNorm, a norm without weight, intermediate values used elsewhere) is left to `route_all_reduces`
and the report says why. The fused op returns (y, h); h replaces the residual stream's uses.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from tpweave.compiler.graph_utils import (
    COLLECTIVE_TARGETS,
    CONVERT,
    GraphEditor,
    all_reduce_waits,
    aten,
    funcol,
    is_tensor_node,
    tpw,
    val,
)
from tpweave.compiler.report import GraphReport
from tpweave.compiler.tp_group import TPGroup
from tpweave.ops.strategies import has_own

COLLECTIVE_OPS = set(COLLECTIVE_TARGETS.values()) | {funcol.wait_tensor.default}
KIND = "all_reduce_rms_norm"


@dataclass(frozen=True)
class RMSNormMatch:
    """An RMSNorm found in the graph: its output y, its (H,) weight, eps, whether the weight multiplies in fp32
    before the cast (Gemma / F.rms_norm style), and its nodes between the input and y."""

    y: fx.Node  # the norm's output, replaced by the fused op's first result
    weight: fx.Node
    eps: float
    weight_in_fp32: bool
    chain: tuple[fx.Node, ...]  # the norm's nodes, dead once y and h are replaced


class NoMatch(Exception):
    """The graph does not have the expected pattern here; the message says what differs."""

    pass


def _calls(node: fx.Node, *targets) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target in targets]


def _only_user(node: fx.Node, *targets) -> fx.Node:
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target not in targets:
        raise NoMatch(f"{node.name} is not used by exactly one of {[str(t) for t in targets]}")
    return users[0]


def _other(node: fx.Node, known: fx.Node):
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _is_weight(w, hidden: int) -> bool:
    return is_tensor_node(w) and tuple(val(w).shape) == (hidden,)


def match_rms_norm(h: fx.Node) -> RMSNormMatch:
    """The RMSNorm applied to h (shape (..., H)), or NoMatch saying what differs (module doc: the forms)."""
    hv = val(h)
    if not isinstance(hv.shape[-1], int):
        raise NoMatch("hidden size is not static")
    why = NoMatch("no RMSNorm reads it")
    for h32, square in _squares_of(h):
        try:
            return _norm_from_square(h, h32, square)
        except NoMatch as e:
            why = e
    raise why


def _squares_of(h: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(h32, h32^2) pairs: h32 = h, or its fp32 upcast; the square as pow(h32, 2) or h32 * h32."""
    ups = [h] if val(h).dtype == torch.float32 else [u for u in _calls(h, CONVERT) if val(u).dtype == torch.float32]
    pairs = []
    for h32 in ups:
        pairs += [(h32, u) for u in _calls(h32, aten.pow.Tensor_Scalar) if u.args[1] == 2]
        pairs += [(h32, u) for u in _calls(h32, aten.mul.Tensor) if u.args[0] is h32 and u.args[1] is h32]
    return pairs


def _norm_from_square(h: fx.Node, h32: fx.Node, square: fx.Node) -> RMSNormMatch:
    """Follow square -> mean -> + eps -> rsqrt -> * h32 -> weight (one user each), or NoMatch."""
    hv = val(h)
    mean = _only_user(square, aten.mean.dim)
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if len(mean.args[1]) != 1 or mean.args[1][0] not in (-1, hv.dim() - 1) or not keepdim:
        raise NoMatch("mean is not over the last dim with keepdim")
    add = _only_user(mean, aten.add.Tensor, aten.add.Scalar)
    eps = _other(add, mean)
    if not isinstance(eps, (int, float)):
        raise NoMatch("eps is not a constant")
    rsqrt = _only_user(add, aten.rsqrt.default)
    n32 = _only_user(rsqrt, aten.mul.Tensor)
    if _other(n32, rsqrt) is not h32:
        raise NoMatch("rsqrt does not scale the same input")
    if h32 is not h and set(h32.users) - {square, n32}:
        raise NoMatch("the upcast input is used elsewhere")
    y, weight, weight_in_fp32, tail = _scaled(n32, hv.dtype)
    if not _is_weight(weight, hv.shape[-1]):
        raise NoMatch(f"the scale is not a ({hv.shape[-1]},) tensor")
    head = [h32] if h32 is not h else []
    return RMSNormMatch(y, weight, float(eps), weight_in_fp32, (*head, square, mean, add, rsqrt, n32, *tail))


def _scaled(n32: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, fx.Node, bool, list[fx.Node]]:
    """(y, weight, weight_in_fp32, nodes between n32 and y) for y = weight * dtype(n32) (Llama/HF) or
    y = dtype(n32 * weight) (Gemma-style, F.rms_norm)."""
    nxt = _only_user(n32, CONVERT, aten.mul.Tensor)
    if nxt.target is CONVERT and val(nxt).dtype == dtype:
        y = _only_user(nxt, aten.mul.Tensor)
        return y, _other(y, nxt), False, [nxt]
    if dtype == torch.float32:
        return nxt, _other(nxt, n32), True, []
    y = _only_user(nxt, CONVERT)
    if val(y).dtype != dtype:
        raise NoMatch("the normalized value is cast to another dtype")
    return y, _other(nxt, n32), True, [nxt]


def match_residual_norm(src: fx.Node, graph: fx.Graph) -> tuple[fx.Node, fx.Node | None, RMSNormMatch]:
    """(h, residual, norm) for `src` -> (+ residual) -> RMSNorm, where h = src + residual (or src), or NoMatch."""
    h, residual = src, None
    adds = _calls(src, aten.add.Tensor)
    if len(src.users) == 1 and adds and len(adds[0].args) == 2 and not adds[0].kwargs:
        other = _other(adds[0], src)
        if (
            is_tensor_node(other)
            and other is not src
            and val(other).shape == val(src).shape
            and val(other).dtype == val(src).dtype
        ):
            h, residual = adds[0], other
    norm = match_rms_norm(h)
    order = {n: i for i, n in enumerate(graph.nodes)}
    early = [u for u in h.users if u not in norm.chain and order[u] < order[norm.y]]
    if early:
        raise NoMatch(f"{early[0].name} reads the sum before the norm's output")
    return h, residual, norm


def _replace_with_fused(
    graph: fx.Graph, edit: GraphEditor, target, args: tuple, h: fx.Node, norm: RMSNormMatch, dead: set
) -> fx.Node:
    """Insert target(*args) -> (y, h) before the norm's output and make the graph read it."""
    fused = edit.insert(target, args, before=norm.y)
    y_new = edit.insert(operator.getitem, (fused, 0), before=norm.y)
    h_new = edit.insert(operator.getitem, (fused, 1), before=norm.y)
    norm.y.replace_all_uses_with(y_new)
    h.replace_all_uses_with(h_new)
    edit.erase_unused({norm.y, *norm.chain, h, *dead})
    return fused


def _describe(residual, norm: RMSNormMatch, policy: str) -> str:
    style = "weight in fp32" if norm.weight_in_fp32 else "weight after the cast"
    return f"{'residual add + ' if residual is not None else ''}RMSNorm ({style}, eps {norm.eps:g}), policy {policy!r}"


def fuse_all_reduce_norms(
    graph: fx.Graph, cfg: TPGroup, *, policy_for: Callable[[str, int, int], str], report: GraphReport
) -> None:
    """Plain-TP graph: all-reduce -> (+ residual) -> RMSNorm becomes tpweave::all_reduce_rms_norm where the
    site's policy is not "sequential"; matches that fail are added to `report` with the reason.

        before:  r = wait_tensor(all_reduce(x, "sum", group))        after:  f = all_reduce_rms_norm(x, res, w, eps,
                 h = add(r, res)                                                    w_in_fp32, group, TP, policy)
                 h32 = float(h); ... y = w * bf16(h32 * rsqrt(...))         y = f[0]
                 (readers of h, readers of y)                               h = f[1]
    """
    edit = GraphEditor(graph)
    for wait, ar in all_reduce_waits(graph):
        x, reduce_op, group_name = ar.args[:3]
        hidden = val(x).shape[-1] if val(x).dim() else None
        if not isinstance(hidden, int) or reduce_op != "sum" or group_name != cfg.group_name or len(ar.users) != 1:
            continue
        policy = policy_for(KIND, hidden, hidden)
        if policy == "sequential":
            continue  # measured (or default): Inductor's own add + norm after the all-reduce
        try:
            h, residual, norm = match_residual_norm(wait, graph)
        except NoMatch as e:
            report.add(KIND, ar, "left alone", str(e))
            continue
        args = (x, residual, norm.weight, norm.eps, norm.weight_in_fp32, group_name, cfg.world_size, policy)
        _replace_with_fused(graph, edit, tpw.all_reduce_rms_norm.default, args, h, norm, {wait, ar})
        report.add(KIND, ar, "fused", _describe(residual, norm, policy))


def fuse_reduce_scatter_norms(graph: fx.Graph, *, report: GraphReport) -> None:
    """SP graph, after async TP: tpweave::mm_rs -> (+ residual) -> RMSNorm becomes tpweave::mm_rs_rms_norm
    where the site's policy names a strategy that finishes its reduction inside the norm kernel.

        before:  s = mm_rs(a, w, group, TP, policy)                   after:  f = mm_rs_rms_norm(a, w, res, nw, eps,
                 h = add(s, res)                                                    w_in_fp32, group, TP, policy)
                 y = nw * bf16(norm(h))                                     y, h = f[0], f[1]
    """
    edit = GraphEditor(graph)
    for mm_rs in [n for n in graph.nodes if n.target is tpw.mm_rs.default]:
        a, w, group_name, world_size, policy = mm_rs.args
        if not has_own(policy, "mm_rs_rms_norm"):
            continue  # no strategy of this site has a fused epilogue: Inductor's own add + norm
        try:
            h, residual, norm = match_residual_norm(mm_rs, graph)
        except NoMatch as e:
            report.add("mm_rs_rms_norm", mm_rs, "left alone", str(e))
            continue
        args = (a, w, residual, norm.weight, norm.eps, norm.weight_in_fp32, group_name, world_size, policy)
        _replace_with_fused(graph, edit, tpw.mm_rs_rms_norm.default, args, h, norm, {mm_rs})
        report.add("mm_rs_rms_norm", mm_rs, "fused", _describe(residual, norm, policy))


def _hoist(node: fx.Node, before: fx.Node) -> bool:
    """Make `node` come before `before` in the graph, moving it (and the inputs it needs) up; False (graph
    unchanged) if that would move a collective."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    moves, stack = [], [node]
    while stack:
        n = stack.pop()
        if order[n] < order[before] or n in moves:
            continue
        if n.op != "call_function" or n.target in COLLECTIVE_OPS or getattr(n.target, "namespace", "") == "tpweave":
            return False
        moves.append(n)
        stack += n.all_input_nodes
    for n in sorted(moves, key=order.get):
        before.prepend(n)
    return True


def fuse_split_all_reduce_norms(
    graph: fx.Graph, cfg: TPGroup, *, subset: dict[fx.Node, int], num_sms: int, report: GraphReport
) -> dict[fx.Node, int]:
    """Token-split graph (after the split and the interleaving): each subset's all-reduce -> (+ residual) ->
    RMSNorm becomes a fused all-reduce + norm started on a side stream on at most num_sms SMs where the
    all-reduce started, and waited for where the all-reduce was waited for, so that the norm too runs under the
    other subset's matmuls. `subset`: all-reduce node -> 0 (A) or 1 (B); returns the same for the new nodes.

        before:  ar = all_reduce(x_A)                        after:  f = all_reduce_rms_norm_start(x_A, res_A, w, eps,
                 g_B = mm(y_B, w_up) ...                                   w_in_fp32, group, TP, num_sms)
                 r = wait_tensor(ar)                                 y, h = f[0], f[1]
                 h = add(r, res_A); y = w * bf16(norm(h))            g_B = mm(y_B, w_up) ...
                 (readers of h, readers of y)                        all_reduce_rms_norm_wait(y, h, x_A, res_A, w, ...)
                                                                     (readers of h, readers of y)
    """
    from tpweave.ops.strategies.triton_ar_norm import side_stream_supported

    edit, labels = GraphEditor(graph), {}
    for wait, ar in all_reduce_waits(graph):
        k = subset.get(ar)
        x, reduce_op, group_name = ar.args[:3]
        xv = val(x)
        if k is None or reduce_op != "sum" or group_name != cfg.group_name or len(ar.users) != 1:
            continue
        if xv.device.type == "cuda" and not side_stream_supported(xv.device, xv.dtype, cfg.world_size):
            why = "no fused all-reduce + norm kernel here (it needs symmetric memory and TP a power of 2)"
            report.add(KIND, ar, "left alone", why)
            continue
        try:
            h, residual, norm = match_residual_norm(wait, graph)
        except NoMatch as e:
            report.add(KIND, ar, "left alone", str(e))
            continue
        # the residual and weight are needed where the all-reduce starts: computed there already, or moved there
        # (a subset's slice of the residual stream is made where it is first read)
        if not all(_hoist(n, ar) for n in (residual, norm.weight) if isinstance(n, fx.Node)):
            report.add(KIND, ar, "left alone", "the residual or norm weight depends on a collective after the start")
            continue
        anchor = ar.next
        args = (x, residual, norm.weight, norm.eps, norm.weight_in_fp32, group_name, cfg.world_size, num_sms)
        start = edit.insert(tpw.all_reduce_rms_norm_start.default, args, before=anchor)
        y_new = edit.insert(operator.getitem, (start, 0), before=anchor)
        h_new = edit.insert(operator.getitem, (start, 1), before=anchor)
        wait_args = (y_new, h_new, x, residual, norm.weight, group_name, cfg.world_size)
        done = edit.insert(tpw.all_reduce_rms_norm_wait.default, wait_args, before=wait)
        report.add(KIND, ar, "fused", f"{_describe(residual, norm, f'side stream, {num_sms} SMs')}, subset {'AB'[k]}")
        norm.y.replace_all_uses_with(y_new)
        h.replace_all_uses_with(h_new)
        edit.erase_unused({norm.y, *norm.chain, h, wait, ar})
        labels[start] = labels[done] = k
    return labels
