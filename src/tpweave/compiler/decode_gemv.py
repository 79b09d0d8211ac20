"""Linear layers through tpweave's decode-size GEMV: each matmul of the graph whose second operand is a
weight (an input of the graph, 2-D with contiguous rows, transposed: the GEMV reads it before its PDL wait)
becomes `tpweave::linear` (ops/gemv.py), which runs a one-kernel Triton GEMV when the call has few rows (decode)
and torch's matmul otherwise. A SiLU-gated MLP's activation goes into its down projection's op, where the GEMV
reads silu(gate) * up itself.

Before:                                         After:
    wt = permute(w, [1, 0])
    y = mm(x, wt)                                   y = tpweave.linear(x, w, False)

    gu = mm(h, permute(w_gu, [1, 0]))               gu = tpweave.linear(h, w_gu, False)
    gate, up = split(gu, K, -1)
    a = mul(silu(gate), up)                         y = tpweave.linear(gu, w_down, True)
    y = mm(a, permute(w_down, [1, 0]))

    h = add(s, residual)                            qh = tpweave.rms_norm_linear(s, residual, g, w, eps, ...)
    y = rms_norm(h, g, eps)      (its ATen ops)     q = getitem(qh, 0)
    q = mm(y, permute(w, [1, 0]))                   h = getitem(qh, 1)      (h's other users read this one)

silu(gate) is recognised in the forms the decompositions give it (silu, g * sigmoid(g), g / (1 + exp(-g)))
with dtype casts around its parts. With `norms` (CompileOptions.norm_gemv, off by default: measured slower in the
engine's batch-1 step, docs/architecture.md) the RMSNorm goes in too, in the forms compiler/allreduce_norm.py
matches, when its output is read by one linear layer alone (a fused QKV or gate_up projection) and the residual
stream is not read before it. At one row the op is one GEMV kernel that normalizes as it reads (ops/gemv.py:
norm_gemv), which takes the norm's kernel out of each decode step; above, the add + norm kernel and `linear`.
The pass runs last, after the collectives' passes (an all-reduce + norm they fused is no longer an add here), on
the plain and the token-split graphs (the SP graph serves M in the thousands).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from tpweave.compiler.allreduce_norm import NoMatch, RMSNormMatch, match_rms_norm
from tpweave.compiler.graph_utils import CONVERT, GraphEditor, is_tensor_node, val
from tpweave.compiler.report import GraphReport

aten = torch.ops.aten
tpw = torch.ops.tpweave


@dataclass(frozen=True)
class LinearMatch:
    """mm(x, permute(weight)) of one linear layer; with silu_mul, x is the [gate | up] tensor whose halves the
    matched mul combined as silu(gate) * up."""

    mm: fx.Node
    x: fx.Node
    weight: fx.Node
    silu_mul: bool


def _uncast(node):
    while isinstance(node, fx.Node) and node.target is CONVERT:
        node = node.args[0]
    return node


def _weight_of(wt) -> fx.Node | None:
    """w for wt = permute(w, [1, 0]) or t(w), w a 2-D tensor with contiguous rows (a linear layer's (N, K))."""
    if not isinstance(wt, fx.Node):
        return None
    if wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]:
        w = wt.args[0]
    elif wt.target is aten.t.default:
        w = wt.args[0]
    else:
        return None
    v = val(w)
    if not (isinstance(v, torch.Tensor) and v.dim() == 2 and v.stride(1) == 1 and v.stride(0) == v.shape[1]):
        return None
    return w


def weight_input(wt) -> fx.Node | None:
    """w for wt = permute(w, [1, 0]) or t(w) (_weight_of) where w is an input of the graph (a placeholder, or a
    get_attr constant): no kernel of the graph writes it, so a kernel may read it before its PDL wait (ops/pdl.py)."""
    w = _weight_of(wt)
    return w if w is not None and w.op in ("placeholder", "get_attr") else None


def _silu_input(node) -> fx.Node | None:
    """g where node computes silu(g) (in one of its decomposed forms, casts aside), else None."""
    node = _uncast(node)
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.silu.default:
        return _uncast(node.args[0])
    if node.target is aten.mul.Tensor:
        for a, b in (node.args, node.args[::-1]):
            b = _uncast(b)
            if isinstance(b, fx.Node) and b.target is aten.sigmoid.default and _uncast(b.args[0]) is _uncast(a):
                return _uncast(a)
    if node.target is aten.div.Tensor:
        g, den = _uncast(node.args[0]), _uncast(node.args[1])
        if isinstance(den, fx.Node) and den.target is aten.add.Tensor and den.args[1] == 1:
            e = _uncast(den.args[0])
            if isinstance(e, fx.Node) and e.target is aten.exp.default:
                neg = _uncast(e.args[0])
                if isinstance(neg, fx.Node) and neg.target is aten.neg.default and _uncast(neg.args[0]) is g:
                    return g
    return None


def _halves(gate, up) -> fx.Node | None:
    """src when gate, up are the first and second halves of src (M, 2K) along its last dim, else None."""
    if not (isinstance(gate, fx.Node) and isinstance(up, fx.Node)):
        return None
    if not (gate.target is up.target is operator.getitem) or gate.args[0] is not up.args[0]:
        return None
    if (gate.args[1], up.args[1]) != (0, 1):
        return None
    split = gate.args[0]
    src = split.args[0]
    v = val(src)
    if not (isinstance(v, torch.Tensor) and v.dim() == 2 and v.stride(1) == 1) or not isinstance(v.shape[1], int):
        return None
    half = v.shape[1] // 2
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, 1) or v.shape[1] != 2 * half:
        return None
    if split.target is aten.split.Tensor and split.args[1] == half:
        return src
    if split.target is aten.split_with_sizes.default and list(split.args[1]) == [half, half]:
        return src
    return None


def gated_input(x, k: int) -> fx.Node | None:
    """[gate | up] when x = silu(gate) * up for the two halves of one (M, 2k) tensor, else None."""
    x = _uncast(x)
    if not (isinstance(x, fx.Node) and x.target is aten.mul.Tensor and len(x.args) == 2):
        return None
    for a, b in (x.args, x.args[::-1]):
        src = _halves(_silu_input(a), _uncast(b))
        if src is not None and val(src).shape[1] == 2 * k:
            return src
    return None


def match_linear(mm: fx.Node) -> LinearMatch | None:
    """The linear layer at an mm node, or None (not a weight operand, or dtypes that differ)."""
    if mm.target is not aten.mm.default:
        return None
    x, w = mm.args[0], weight_input(mm.args[1])
    if w is None or not isinstance(val(x), torch.Tensor) or val(x).dtype != val(w).dtype:
        return None
    gated = gated_input(x, val(w).shape[1])
    if gated is not None and val(gated).dtype == val(w).dtype:
        return LinearMatch(mm, gated, w, True)
    return LinearMatch(mm, x, w, False)


@dataclass(frozen=True)
class NormLinearMatch:
    """h = add(s, residual) -> RMSNorm -> y, and y read by one linear layer alone (not a gated one)."""

    h: fx.Node
    s: fx.Node
    residual: fx.Node
    norm: RMSNormMatch
    linear: LinearMatch


def match_norm_linear(h: fx.Node, order: dict[fx.Node, int]) -> NormLinearMatch | None:
    """The residual add + RMSNorm + linear layer from the add at h, or None. order: the graph's node positions."""
    if h.op != "call_function" or h.target is not aten.add.Tensor or len(h.args) != 2 or h.kwargs:
        return None
    s, residual = h.args
    if not (is_tensor_node(s) and is_tensor_node(residual)) or val(h).dim() != 2:
        return None
    if any(val(t).shape != val(h).shape or val(t).dtype != val(h).dtype for t in (s, residual)):
        return None
    try:
        norm = match_rms_norm(h)
    except NoMatch:
        return None
    if len(norm.y.users) != 1 or val(norm.y).dtype != val(h).dtype:
        return None
    linear = match_linear(next(iter(norm.y.users)))
    if linear is None or linear.silu_mul or linear.x is not norm.y:
        return None
    if any(u not in norm.chain and order[u] < order[norm.y] for u in h.users):
        return None  # the residual stream is read before the norm's output: h must exist earlier
    return NormLinearMatch(h, s, residual, norm, linear)


def route_linears(graph: fx.Graph, *, report: GraphReport, norms: bool = False) -> list[LinearMatch]:
    """Put tpweave::linear in place of every linear layer's matmul, and with `norms` tpweave::rms_norm_linear in
    place of a residual add + RMSNorm + linear layer (module doc); the linear layers' matches."""
    edit = GraphEditor(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    normed = [m for n in list(graph.nodes) if norms and (m := match_norm_linear(n, order)) is not None]
    dead: set[fx.Node] = set()
    # an earlier match's add and mm -> the op's h and y (a later match may read them: the next layer's residual)
    replaced: dict[fx.Node, fx.Node] = {}
    for m in normed:
        s, residual = replaced.get(m.s, m.s), replaced.get(m.residual, m.residual)
        args = (s, residual, m.norm.weight, m.linear.weight, m.norm.eps, m.norm.weight_in_fp32)
        fused = edit.insert(tpw.rms_norm_linear.default, args, before=m.norm.y)
        y = edit.insert(operator.getitem, (fused, 0), before=m.norm.y)
        h = edit.insert(operator.getitem, (fused, 1), before=m.norm.y)
        m.linear.mm.replace_all_uses_with(y)
        m.h.replace_all_uses_with(h)
        replaced |= {m.h: h, m.linear.mm: y}
        dead |= {m.linear.mm, m.linear.mm.args[1], m.norm.y, *m.norm.chain, m.h}
    edit.erase_unused(dead)
    report.norm_linears += len(normed)
    matches = [m for n in list(graph.nodes) if (m := match_linear(n)) is not None]
    dead = set()
    replaced: dict[fx.Node, fx.Node] = {}  # an earlier match's mm -> its op (a gate_up projection feeding a match)
    for m in matches:
        x = replaced.get(m.x, m.x)
        node = edit.insert(tpw.linear.default, (x, m.weight, m.silu_mul), before=m.mm)
        node.meta["val"] = m.mm.meta["val"]
        m.mm.replace_all_uses_with(node)
        replaced[m.mm] = node
        dead |= {m.mm, m.mm.args[1], *(between(m.x, m.mm.args[0]) if m.silu_mul else ())}
    edit.erase_unused(dead)
    # += : Inductor runs the pass on each graph of the compile (a training compile's backward too)
    report.linears += len(matches) + len(normed)
    report.gated_linears += sum(m.silu_mul for m in matches)
    return [m.linear for m in normed] + matches


def between(src: fx.Node, out: fx.Node) -> set[fx.Node]:
    """The nodes computing `out` from `src` (out included, src not): the fused activation's parts."""
    found, stack = set(), [out]
    while stack:
        node = stack.pop()
        if node is src or node in found or not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        found.add(node)
        stack.extend(n for n in node.all_input_nodes if n is not src)
    return found
