"""Token-split pass (plain TP graph): the step's token rows run as two subsets, A = rows [0, s) and
B = rows [s, N), ordered so that each subset's all-reduce is in flight while the other subset computes
(the TokenWeave idea, here with the process group's all-reduce).

Rules, on the post-grad ATen graph of a packed model (activations (N, features), N tokens):
- a matmul whose activation has the N token rows (mm, addmm) starts a split: its activation is sliced
  into the two subsets (views) and the matmul runs once per subset;
- row-wise ops on split values run once per subset: pointwise ops, casts, reductions and norms over
  feature dims, views / splits / slices / cats that keep the token dim leading, a gather of a table by
  split indices (RoPE's cos/sin by positions), embedding lookups, the all-reduces and their waits;
  a replicated value with the N token rows that meets a split one is sliced (no copy);
- any other consumer of a split value (attention, which needs every token of a sequence; picking rows
  for the LM head; graph outputs; ops we do not know) gets the two subsets concatenated first.
Split point (split_point): N // 2, rounded down to whole 128-row GEMM tiles from 512 tokens on, so that
subset A's matmuls fill whole waves of tiles; any s is correct, since attention sees all tokens.

Then the subsets are interleaved: the graph is reordered so that subset A runs up to and including the
start of its all-reduce, then subset B up to the start of its own, then A from its wait on, and so on.

Before (one layer's MLP half, N tokens):
    h = wait(all_reduce(o_proj)); x = x + h; y = rms_norm(x); g = mm(y, w_gate_up); a = silu(g) * g'
    d = mm(a, w_down); r = wait(all_reduce(d))
After:
    ar_A = all_reduce(d_A)                       # A's all-reduce in flight ...
    g_B = mm(y_B, w_gate_up); d_B = mm(a_B, w_down)   # ... under B's matmuls
    ar_B = all_reduce(d_B); r_A = wait(ar_A)     # B's in flight under A's next matmuls
    ...
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tpweave.compiler.graph_utils import (
    SAME_SHAPE_OPS,
    VIEW_OPS,
    GraphEditor,
    aten,
    funcol,
    is_tensor_node,
    same,
    tpw,
    val,
)
from tpweave.compiler.report import GraphReport
from tpweave.compiler.tp_group import TPGroup

MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> index of the activation (rows) argument
FEATURE_DIM_OPS = {  # ops whose `dim` argument (index 1) must not be the token dim
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.amax.default,
    aten.amin.default,
    aten.var_mean.correction,
    aten._softmax.default,
    aten._log_softmax.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.slice.Tensor,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.select.int,
    aten.chunk.default,
}
COLLECTIVES = {funcol.all_reduce.default, funcol.wait_tensor.default}


@dataclass
class Halves:
    """The two subsets of a split node: `a` its rows [0, s), `b` its rows [s, N)."""

    a: fx.Node
    b: fx.Node


ALIGN = 128  # rows of a GEMM tile: a subset of whole tiles leaves no partly filled wave of tiles
ALIGN_FROM = 512  # tokens from which subset A is rounded down to whole tiles (below: the halves as they are)


def split_point(num_rows: int) -> int:
    """Rows of subset A: M // 2, rounded down to a multiple of ALIGN from ALIGN_FROM rows on (subset B then has
    M - s >= s rows, fewer than 2 x ALIGN more). The graph computes the same with its symbolic M, no guards:
    s = M//2 - (M//2 % ALIGN) * min(1, M // ALIGN_FROM)."""
    half = num_rows // 2
    return half - (half % ALIGN) * min(1, num_rows // ALIGN_FROM)


class NotRowWise(Exception):
    """The op is not known to be row-wise on split inputs; the message says why."""


class TokenSplitPass:
    """Rewrites one graph in place by the rules of the module docstring, noting what it did in `report`."""

    def __init__(self, graph: fx.Graph, cfg: TPGroup, report: GraphReport):
        self.graph, self.cfg, self.report = graph, cfg, report
        self.edit = GraphEditor(graph)
        self.halves: dict[fx.Node, Halves] = {}
        self.sliced: dict[fx.Node, Halves] = {}
        self.joined: dict[fx.Node, fx.Node] = {}
        self.replaced: set[fx.Node] = set()
        self.subset: dict[fx.Node, int] = {}  # 0: subset A, 1: subset B
        self.rows: Any = None  # N: the token rows of the all-reduced activations (int or SymInt)
        self.bounds: tuple = ()  # FX args (s, N, N - s): subset A is rows [0, s), B rows [s, N)
        self.feeds_all_reduce: set[fx.Node] = set()  # nodes an all-reduce depends on

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> bool:
        """Split and interleave; False (graph unchanged) where there is nothing to split."""
        reduced = [n.args[0] for n in self.graph.nodes if n.target is funcol.all_reduce.default]
        if not reduced:
            self.report.notes.append("token split: no all-reduce in this graph, nothing to overlap")
            return False
        x = val(reduced[0])
        if x.dim() != 2:
            self.report.notes.append(
                f"token split: left alone, the all-reduced activation is {x.dim()}-D (packed (tokens, features) "
                "activations only; (batch, seq) models are not split yet)"
            )
            return False
        self.rows = x.shape[0]
        if isinstance(self.rows, int) and self.rows < 2:
            self.report.notes.append("token split: left alone, one token row")
            return False
        self._insert_bounds()
        stack = list(reduced)
        while stack:
            n = stack.pop()
            if n not in self.feeds_all_reduce:
                self.feeds_all_reduce.add(n)
                stack += n.all_input_nodes
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._join_inputs(node)
            elif node.op == "call_function" and node not in self.subset:
                self._visit(node)
        self.edit.erase_unused(self.replaced)
        for n in self.graph.nodes:
            if n.target is funcol.all_reduce.default:
                k = self.subset.get(n)
                self.report.add("all_reduce", n, "token split" if k is not None else "left alone",
                                f"subset {'AB'[k]}" if k is not None else "not on split rows")  # fmt: skip
        self._interleave()
        return True

    def _insert_bounds(self) -> None:
        """s (split_point), N and N - s as FX arguments, computed right after the placeholders."""
        anchor = next(n for n in self.graph.nodes if n.op != "placeholder")
        if isinstance(self.rows, int):
            split = split_point(self.rows)
            self.bounds = (split, self.rows, self.rows - split)
            return
        n_arg = None
        for p in self.graph.nodes:
            if p.op != "placeholder":
                break
            v = val(p)
            if isinstance(v, torch.SymInt) and v.node.expr == self.rows.node.expr:
                n_arg = p
                break
            if n_arg is None and isinstance(v, torch.Tensor) and v.dim() >= 1 and same(v.shape[0], self.rows):
                n_arg = self.edit.insert(aten.sym_size.int, (p, 0), before=anchor)
        assert n_arg is not None, "the token count is the size of no graph input"
        half = self.edit.insert(operator.floordiv, (n_arg, 2), before=anchor)
        large = self.edit.insert(operator.floordiv, (n_arg, ALIGN_FROM), before=anchor)
        large = self.edit.insert(torch.sym_min, (1, large), before=anchor)  # 1 from ALIGN_FROM tokens on, else 0
        excess = self.edit.insert(operator.mod, (half, ALIGN), before=anchor)
        excess = self.edit.insert(operator.mul, (excess, large), before=anchor)
        s_arg = self.edit.insert(operator.sub, (half, excess), before=anchor)
        self.bounds = (s_arg, n_arg, self.edit.insert(operator.sub, (n_arg, s_arg), before=anchor))

    # ---- per node -----------------------------------------------------------------------------
    def _visit(self, node: fx.Node) -> None:
        split_in = any(a in self.halves for a in node.all_input_nodes)
        if not split_in and not self._starts_split(node):
            return
        try:
            a, b = (self._clone(node, k) for k in (0, 1))
        except NotRowWise:
            self._join_inputs(node)
            return
        self.halves[node] = Halves(a, b)
        self.replaced.add(node)

    def _starts_split(self, node: fx.Node) -> bool:
        """A matmul of the N token rows that an all-reduce depends on (not, say, an LM head over every token)."""
        index = MATMULS.get(node.target)
        return index is not None and node in self.feeds_all_reduce and self._token_rows(node.args[index])

    def _token_rows(self, x: Any) -> bool:
        """Whether x is a tensor node whose leading dim is the N token rows."""
        return is_tensor_node(x) and val(x).dim() >= 1 and same(val(x).shape[0], self.rows)

    def _clone(self, node: fx.Node, k: int) -> fx.Node:
        """The node computed on subset k's rows (NotRowWise if it is not known to be row-wise)."""
        self._check_row_wise(node)

        def sub(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in self.halves:
                    return (self.halves[a].a, self.halves[a].b)[k]
                if self._token_rows(a):
                    return self._slice(a, k, before=node)
                return a
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        args, kwargs = sub(node.args), {key: sub(v) for key, v in node.kwargs.items()}
        if node.target in VIEW_OPS or node.target is aten.expand.default:
            args = (args[0], [self._half_rows(k), *args[1][1:]], *args[2:])
        clone = self.edit.insert(node.target, args, kwargs, before=node)
        self.subset[clone] = k
        return clone

    def _check_row_wise(self, node: fx.Node) -> None:
        t = node.target
        if t is operator.getitem or t in SAME_SHAPE_OPS or t in COLLECTIVES:
            if t is funcol.all_reduce.default and node.args[2] != self.cfg.group_name:
                raise NotRowWise("not the TP group")
            return
        if t in MATMULS:
            others = [a for i, a in enumerate(node.args) if i != MATMULS[t] and a in self.halves]
            if others or not (node.args[MATMULS[t]] in self.halves or self._token_rows(node.args[MATMULS[t]])):
                raise NotRowWise("a split weight operand")
            return
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            for a in node.all_input_nodes:
                if is_tensor_node(a) and a not in self.halves and not self._token_rows(a) and val(a).dim() >= 2:
                    if not same(val(a).shape[0], 1):
                        raise NotRowWise("a pointwise operand with other leading rows")
            return
        if t in FEATURE_DIM_OPS or t is aten.cat.default:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            if t is aten.cat.default:
                dims = node.args[1] if len(node.args) > 1 else 0
                if not all(a in self.halves or self._token_rows(a) for a in node.args[0]):
                    raise NotRowWise("cat of a non-split tensor")
            if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
                dims = node.args[2] if len(node.args) > 2 else 0
            ndim = val(node.all_input_nodes[0]).dim()
            for d in dims if isinstance(dims, (list, tuple)) else [dims]:
                if d % ndim == 0:
                    raise NotRowWise("an op over the token dim")
            return
        if t in VIEW_OPS or t is aten.expand.default:
            shape = node.args[1]
            out = val(node).shape
            if not (len(out) >= 1 and same(out[0], self.rows) and len(shape) >= 1):
                raise NotRowWise("a view that moves the token dim")
            return
        if t is aten.index.Tensor:
            table, indices = node.args[0], node.args[1]
            if table in self.halves or len(indices) != 1 or indices[0] not in self.halves:
                raise NotRowWise("an index into the token rows")
            return
        if t is aten.embedding.default:
            if node.args[0] in self.halves:
                raise NotRowWise("a split embedding table")
            return
        raise NotRowWise(f"{t} is not known to be row-wise")

    def _half_rows(self, k: int) -> Any:
        """Rows of subset k: s, or N - s (FX arguments)."""
        return self.bounds[0] if k == 0 else self.bounds[2]

    def _slice(self, x: fx.Node, k: int, *, before: fx.Node) -> fx.Node:
        """Subset k's rows of a replicated token-rows node (a view), one per node and subset."""
        if x not in self.sliced:
            s, n, _ = self.bounds
            a = self.edit.insert(aten.slice.Tensor, (x, 0, 0, s), before=before)
            b = self.edit.insert(aten.slice.Tensor, (x, 0, s, n), before=before)
            self.subset[a], self.subset[b] = 0, 1
            self.sliced[x] = Halves(a, b)
        return (self.sliced[x].a, self.sliced[x].b)[k]

    def _join(self, node: fx.Node) -> fx.Node:
        """The full value of a split node: its subsets concatenated (once, right after the later one)."""
        if node not in self.joined:
            h = self.halves[node]
            if isinstance(val(node), (tuple, list)):
                raise NotImplementedError(f"token split: a consumer needs all rows of the tuple-valued {node.name}")
            self.joined[node] = self.edit.insert(aten.cat.default, ([h.a, h.b], 0), before=h.b.next)
        return self.joined[node]

    def _join_inputs(self, node: fx.Node) -> None:
        for inp in list(node.all_input_nodes):
            if inp in self.halves:
                node.replace_input_with(inp, self._join(inp))

    # ---- interleaving -------------------------------------------------------------------------
    def _interleave(self) -> None:
        """Reorder the graph: run one subset until it has started an all-reduce, then the other (a list
        schedule over the graph order; nodes of neither subset run as soon as they are ready)."""
        nodes = [n for n in self.graph.nodes if n.op not in ("placeholder", "output")]
        position = {n: i for i, n in enumerate(nodes)}
        remaining = {n: sum(1 for a in n.all_input_nodes if a in position) for n in nodes}
        ready = sorted((n for n in nodes if remaining[n] == 0), key=position.get)
        order: list[fx.Node] = []
        current = 0
        while ready:
            pick = next((n for n in ready if self.subset.get(n) is None), None)
            if pick is None:
                pick = next((n for n in ready if self.subset.get(n) == current), ready[0])
            ready.remove(pick)
            order.append(pick)
            if pick.target is funcol.all_reduce.default and self.subset.get(pick) == current:
                current = 1 - current
            elif self.subset.get(pick) is not None and self.subset[pick] != current:
                current = self.subset[pick]
            for user in pick.users:
                if user in remaining:
                    remaining[user] -= 1
                    if remaining[user] == 0:
                        ready.append(user)
                        ready.sort(key=position.get)
        assert len(order) == len(nodes), "token split: the reordered graph lost nodes"
        anchor = next(n for n in self.graph.nodes if n.op == "output")
        for n in order:
            anchor.prepend(n)
        self.report.schedule = schedule(self.graph, self.subset)


SCHEDULE_KINDS = {
    **dict.fromkeys(MATMULS, "mm"),
    funcol.all_reduce.default: "all_reduce",
    funcol.wait_tensor.default: "wait",
    tpw.all_reduce_rms_norm_start.default: "all_reduce",
    tpw.all_reduce_rms_norm_wait.default: "wait",
}


def schedule(graph: fx.Graph, subset: dict[fx.Node, int]) -> list[str]:
    """The split graph's matmuls, all-reduce starts and waits in graph order, with their subsets: "mm A", ..."""
    return [
        f"{SCHEDULE_KINDS[n.target]} {'AB'[subset[n]]}"
        for n in graph.nodes
        if n.target in SCHEDULE_KINDS and n in subset
    ]
