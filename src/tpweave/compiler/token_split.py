"""Token-split pass (plain TP graph): the step's rows run as two subsets, A and B, ordered so that each
subset's all-reduce is in flight while the other subset computes (the TokenWeave idea, here with the
process group's all-reduce).

The unit U of the split, from the all-reduced activations:
- packed models, activations (N, features): the N tokens; A = tokens [0, s), B = tokens [s, N);
- (batch, seq) models (Hugging Face style), activations (B, S, features): the B sequences; A = batch
  elements [0, s), B = [s, B). Attention is per sequence there, so it stays split too.
Every split value's leading dim is a multiple f x U of the unit (f = 1 for (N, H) or (B, S, H); f = S
for the flattened (B*S, H) matmul activation; f = heads for the (B*nh, S, hd) operands of a bmm
attention). Its subset A is its rows [0, f*s), subset B its rows [f*s, f*U).

Rules, on the post-grad ATen graph:
- a matmul (mm, addmm) that an all-reduce depends on, whose activation's leading dim is a multiple of U,
  starts a split: its activation is sliced into the two subsets (views), the matmul runs once per subset;
- ops independent across their leading rows run once per subset: pointwise ops (operands with the
  output's leading dim split or sliced; lower-rank operands and leading dim 1 broadcast), casts,
  reductions, norms and softmax over other dims, slices / splits / cats / (un)squeezes not on dim 0,
  permutes and transposes that keep dim 0 first, expands that keep it, bmm, SDPA over split q / k / v
  (a mask with their leading dim is sliced, one with leading dim 1 broadcasts), a gather of a table by
  split indices (RoPE's cos/sin by positions), embedding lookups, the all-reduces and waits; a size read
  off a split value (sym_size) is computed from the graph inputs instead;
- a view / reshape whose output's leading dim is a multiple f' x U: a reshape keeps the logical
  row-major order, so subset A (the first s x f rows of its input, s x f x row elements) is exactly its
  first s x f' output rows. (B, S, H) -> (B*S, H) and (B, nh, S, hd) -> (B*nh, S, hd) stay split. That
  the batch is outermost is the permute rule's doing: a permute that moves dim 0 is joined first;
- a replicated value that meets a split one as an operand with its rows is sliced (no copy);
- any other consumer of a split value (a packed model's attention, which needs every token of a
  sequence; picking rows for the LM head; graph outputs; ops not known) gets the two subsets
  concatenated first, and the report notes each op that forced a join (graph outputs aside).
Each rule holds for any cut of the rows, so the numbers are the unsplit graph's whatever the dims mean.

Split point: packed, split_point(N): N // 2, rounded down to whole 128-row GEMM tiles from 512 tokens on,
so that subset A's matmuls fill whole waves of tiles (any s is correct: attention sees all tokens);
(batch, seq): B // 2 (subset B gets the odd sequence). Both are computed in the graph from the symbolic
N or B without guards, so one graph serves every size. A batch of one sequence has a graph of its own
(Dynamo keeps size-1 dims static, compiler/dynamic.py), left whole with a note; a graph with a
symbolic B thus has B >= 2, and both subsets have a sequence (run at B = 1, such a graph would compute
the same with an empty subset A, as a test of the rules checks). At B = 2 or 3 a subset is one sequence,
a size 1 that torch's shape checks specialize on: B = 2, B = 3 and B >= 4 may each get a graph. (Compiling
size-obliviously would fold them into one, but that mode has given wrong logits where a size is 1 at run
time: docs/architecture.md, Dynamic shapes.)

Then the subsets are interleaved: the graph is reordered so that subset A runs up to and including the
start of its all-reduce, then subset B up to the start of its own, then A from its wait on, and so on.

Before (one layer's MLP half of a packed model, N tokens):
    h = wait(all_reduce(o_proj)); x = x + h; y = rms_norm(x); g = mm(y, w_gate_up); a = silu(g) * g'
    d = mm(a, w_down); r = wait(all_reduce(d))
After:
    ar_A = all_reduce(d_A)                       # A's all-reduce in flight ...
    g_B = mm(y_B, w_gate_up); d_B = mm(a_B, w_down)   # ... under B's matmuls
    ar_B = all_reduce(d_B); r_A = wait(ar_A)     # B's in flight under A's next matmuls
    ...
Before (the attention half of a (batch, seq) model, x: (B, S, H), nh heads of hd):
    q = view(mm(view(x, (B*S, H)), w_q), (B, S, nh, hd)).permute(0, 2, 1, 3)   # k, v alike
    o = view(sdpa(q, k, v).permute(0, 2, 1, 3), (B*S, nh*hd)); r = wait(all_reduce(view(mm(o, w_o), (B, S, H))))
After (x_A = x[:s], x_B = x[s:]: the same ops on s and B - s sequences, rows (s*S, H) for the matmuls):
    ar_A = all_reduce(view(mm(o_A, w_o), (s, S, H)))                 # A's all-reduce in flight ...
    q_B = ...; o_B = view(sdpa(q_B, k_B, v_B)...); d_B = mm(o_B, w_o)  # ... under B's attention
    ar_B = all_reduce(view(d_B, (B - s, S, H))); r_A = wait(ar_A)
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

import sympy
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
FEATURE_DIM_OPS = {  # ops whose `dim` argument (index 1; 2 for DIM_AT_2) must not be the leading dim
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
    aten.squeeze.dim,
    aten.select.int,
    aten.chunk.default,
}
DIM_AT_2 = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}  # `dim` is their argument 2
COLLECTIVES = {funcol.all_reduce.default, funcol.wait_tensor.default}
# Attention over (batch, heads, seq, head_dim) q / k / v: independent across the batch dim
SDPA_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
SDPA_ROWS = ("query", "key", "value")
SDPA_MASKS = ("attn_mask", "attn_bias")


@dataclass
class Halves:
    """The two subsets of a split node: `a` its rows [0, f*s), `b` its rows [f*s, f*U)."""

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
        self.factor: dict[fx.Node, Any] = {}  # split node -> f: its leading dim is f x U
        self.sliced: dict[fx.Node, Halves] = {}
        self.joined: dict[fx.Node, fx.Node] = {}
        self.replaced: set[fx.Node] = set()
        self.helpers: set[fx.Node] = set()  # slices and size arithmetic, erased if nothing uses them
        self.subset: dict[fx.Node, int] = {}  # 0: subset A, 1: subset B
        self.unit: Any = None  # U: the tokens N (packed) or the batch B ((batch, seq)), int or SymInt
        self.batch = False  # whether U is the batch of a (batch, seq) model
        self.bounds: tuple = ()  # FX args (s, U, U - s): subset A is units [0, s), B units [s, U)
        self.rows_args: dict[Any, tuple] = {}  # f -> FX args (f*s, f*(U - s), f*U)
        self.size_args: dict[Any, Any] = {}  # sympy size -> FX argument computing it
        self.feeds_all_reduce: set[fx.Node] = set()  # nodes an all-reduce depends on
        self.join_reasons: Counter[str] = Counter()

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> bool:
        """Split and interleave; False (graph unchanged) where there is nothing to split."""
        reduced = [n.args[0] for n in self.graph.nodes if n.target is funcol.all_reduce.default]
        if not reduced:
            self.report.notes.append("token split: no all-reduce in this graph, nothing to overlap")
            return False
        shapes = [val(x).shape for x in reduced]
        batched = [s for s in shapes if len(s) >= 3]
        if batched:  # (batch, seq, ...): split by sequences (a flattened (B*S, H) all-reduce is a multiple of B)
            self.batch, self.unit = True, batched[0][0]
        elif len(shapes[0]) == 2:
            self.unit = shapes[0][0]
        else:
            self.report.notes.append(f"token split: left alone, the all-reduced activation is {len(shapes[0])}-D")
            return False
        if isinstance(self.unit, int) and self.unit < 2:
            what = "a batch of one sequence" if self.batch else "one token row"
            self.report.notes.append(f"token split: left alone, {what}")
            return False
        try:
            self._insert_bounds()
        except NotRowWise as e:
            self.edit.erase_unused(self.helpers)
            self.report.notes.append(f"token split: left alone, {e}")
            return False
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
        self.edit.erase_unused(self.replaced | self.helpers)
        for n in self.graph.nodes:
            if n.target is funcol.all_reduce.default:
                k = self.subset.get(n)
                self.report.add("all_reduce", n, "token split" if k is not None else "left alone",
                                f"subset {'AB'[k]}" if k is not None else "not on split rows")  # fmt: skip
        if self.batch:
            self.report.notes.append("token split: by sequences, subset A = batch elements [0, B // 2)")
        for reason, n in sorted(self.join_reasons.items()):
            self.report.notes.append(f"token split: subsets joined (cat) before {n} op(s): {reason}")
        self._interleave()
        return True

    def _insert_bounds(self) -> None:
        """s (split_point, or B // 2), U and U - s as FX arguments, computed right after the placeholders."""
        anchor = next(n for n in self.graph.nodes if n.op != "placeholder")
        if isinstance(self.unit, int):
            split = self.unit // 2 if self.batch else split_point(self.unit)
            self.bounds = (split, self.unit, self.unit - split)
            return
        u_arg = None
        for p in self.graph.nodes:
            if p.op != "placeholder":
                break
            v = val(p)
            if isinstance(v, torch.SymInt) and v.node.expr == self.unit.node.expr:
                u_arg = p
                break
            if u_arg is None and isinstance(v, torch.Tensor) and v.dim() >= 1 and same(v.shape[0], self.unit):
                u_arg = self.edit.insert(aten.sym_size.int, (p, 0), before=anchor)
        if u_arg is None:  # e.g. B * S tokens of a (batch, seq) model that flattens them
            u_arg = self._size_arg(self.unit.node.expr, before=anchor)
        half = self.edit.insert(operator.floordiv, (u_arg, 2), before=anchor)
        if self.batch:
            s_arg = half
        else:
            large = self.edit.insert(operator.floordiv, (u_arg, ALIGN_FROM), before=anchor)
            large = self.edit.insert(torch.sym_min, (1, large), before=anchor)  # 1 from ALIGN_FROM tokens on, else 0
            excess = self.edit.insert(operator.mod, (half, ALIGN), before=anchor)
            excess = self.edit.insert(operator.mul, (excess, large), before=anchor)
            s_arg = self.edit.insert(operator.sub, (half, excess), before=anchor)
        self.bounds = (s_arg, u_arg, self.edit.insert(operator.sub, (u_arg, s_arg), before=anchor))

    # ---- per node -----------------------------------------------------------------------------
    def _visit(self, node: fx.Node) -> None:
        split_in = any(a in self.halves for a in node.all_input_nodes)
        if not split_in and not self._starts_split(node):
            return
        if node.target is aten.sym_size.int and self._size_from_inputs(node):
            return
        try:
            rows, f = self._rule(node)
            for a in node.all_input_nodes:
                if a in self.halves and a not in rows:
                    raise NotRowWise(f"{_name(node)} with a split operand not on its rows")
            if isinstance(val(node), (tuple, list)):
                self._check_items(node, f)
            for r in rows:  # sizes the slices of replicated operands and a view's leading dim need
                if r not in self.halves:
                    self._rows(self._row_factor(r), before=node)
            if node.target in VIEW_OPS or node.target is aten.expand.default:
                self._rows(f, before=node)
        except NotRowWise as e:
            self.join_reasons[str(e)] += 1
            self._join_inputs(node)
            return
        a, b = (self._clone(node, k, rows, f) for k in (0, 1))
        self.halves[node], self.factor[node] = Halves(a, b), f
        self.replaced.add(node)

    def _size_from_inputs(self, node: fx.Node) -> bool:
        """A size read off a split value, computed from the graph inputs instead (no join); False if it cannot."""
        size = val(node)
        try:
            arg = self._size_arg(size.node.expr, before=node) if isinstance(size, torch.SymInt) else None
        except NotRowWise:
            return False
        if not isinstance(arg, fx.Node):
            return False
        node.replace_all_uses_with(arg)
        self.replaced.add(node)
        return True

    def _starts_split(self, node: fx.Node) -> bool:
        """A matmul of the rows that an all-reduce depends on (not, say, an LM head over every token)."""
        index = MATMULS.get(node.target)
        return index is not None and node in self.feeds_all_reduce and self._factor(node.args[index]) is not None

    def _factor(self, x: Any) -> Any:
        """f with x's leading dim = f x U (an int or SymInt known without guards), None if there is none."""
        if x in self.factor:
            return self.factor[x]
        if not is_tensor_node(x) or val(x).dim() == 0:
            return None
        return self._size_factor(val(x).shape[0])

    def _size_factor(self, size: Any) -> Any:
        if isinstance(size, int) and isinstance(self.unit, int):
            return size // self.unit if size >= self.unit and size % self.unit == 0 else None
        f = size // self.unit
        if isinstance(f, torch.SymInt) and f.node.expr.is_number:
            f = int(f.node.expr)
        if (isinstance(f, int) and f < 1) or not same(f * self.unit, size):
            return None
        return f

    def _rule(self, node: fx.Node) -> tuple[list[fx.Node], Any]:
        """The operands whose leading rows are the output's (split, or sliced if replicated), and the output's
        factor f; NotRowWise if the op is not known to be independent across those rows."""
        t, args = node.target, node.args
        if t is operator.getitem:
            if args[0] not in self.halves:
                raise NotRowWise("an item of a split value's unsplit tuple")
            return [args[0]], self.factor[args[0]]  # the tuple's op checked its items (_check_items)
        if t in SAME_SHAPE_OPS or t in COLLECTIVES:
            if t is funcol.all_reduce.default and args[2] != self.cfg.group_name:
                raise NotRowWise("an all-reduce of another group")
            return [args[0]], self._row_factor(args[0])
        if t in MATMULS:
            x = args[MATMULS[t]]
            f = self._row_factor(x)
            rows = [x]
            if t is aten.addmm.default and is_tensor_node(args[0]) and val(args[0]).dim() == 2:
                rows += self._pointwise_rows([args[0]], val(x).shape[0], 2)
            return rows, f
        if t is aten.bmm.default:
            if not same(val(args[0]).shape[0], val(args[1]).shape[0]):
                raise NotRowWise("bmm operands with other batch sizes")
            return [args[0], args[1]], self._row_factor(args[0])
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            out = val(node)
            if not isinstance(out, torch.Tensor) or out.dim() == 0:
                raise NotRowWise(f"{_name(node)} without leading rows")
            rows = self._pointwise_rows(node.all_input_nodes, out.shape[0], out.dim())  # the split ones among them
            return rows, self._row_factor(rows[0])
        if t in FEATURE_DIM_OPS or t is aten.cat.default or t is aten.unsqueeze.default:
            return self._feature_dim_rule(node)
        if t is aten.permute.default:
            if args[1][0] % val(args[0]).dim() != 0:
                raise NotRowWise("a permute that moves the leading dim")
            return [args[0]], self._row_factor(args[0])
        if t is aten.transpose.int:
            ndim = val(args[0]).dim()
            if args[1] % ndim == 0 or args[2] % ndim == 0:
                raise NotRowWise("a transpose of the leading dim")
            return [args[0]], self._row_factor(args[0])
        if t in VIEW_OPS:
            self._row_factor(args[0])
            out = val(node).shape
            f = self._size_factor(out[0]) if len(out) >= 1 else None
            if f is None:
                raise NotRowWise(f"a view to {tuple(out)}, whose leading dim is no multiple of the split unit")
            return [args[0]], f
        if t is aten.expand.default:
            x = args[0]
            if len(args[1]) != val(x).dim() or not same(val(node).shape[0], val(x).shape[0]):
                raise NotRowWise("an expand of the leading dim")
            return [x], self._row_factor(x)
        if t is aten.index.Tensor:
            table, indices = args[0], args[1]
            if table in self.halves or len(indices) != 1 or indices[0] not in self.halves:
                raise NotRowWise("an index into the split rows")
            return [indices[0]], self._row_factor(indices[0])
        if t is aten.embedding.default:
            return [args[1]], self._row_factor(args[1])
        if t in SDPA_OPS:
            return self._sdpa_rule(node)
        raise NotRowWise(f"{_name(node)} is not known to be row-wise")

    def _row_factor(self, x: Any) -> Any:
        f = self._factor(x)
        if f is None:
            raise NotRowWise("an operand whose leading dim is no multiple of the split unit")
        return f

    def _pointwise_rows(self, inputs: list, size: Any, ndim: int) -> list[fx.Node]:
        """The inputs of a broadcasting op with output leading dim `size` and rank `ndim` that have its rows;
        NotRowWise if one neither has them nor broadcasts along them."""
        rows = []
        for a in inputs:
            if not is_tensor_node(a):
                continue
            shape = val(a).shape
            if len(shape) == ndim and same(shape[0], size):
                rows.append(a)
            elif len(shape) < ndim or same(shape[0], 1):
                if a in self.halves:
                    raise NotRowWise("a split operand broadcast along the rows")
            else:
                raise NotRowWise("an operand with other leading rows")
        return rows

    def _feature_dim_rule(self, node: fx.Node) -> tuple[list[fx.Node], Any]:
        t, args = node.target, node.args
        if t is aten.cat.default:
            dims, rows = args[1] if len(args) > 1 else 0, list(args[0])
            ndim = val(rows[0]).dim()
            if not all(is_tensor_node(a) and val(a).dim() == ndim for a in rows):
                raise NotRowWise("a cat of tensors of other ranks")
            self._pointwise_rows(rows, val(node).shape[0], ndim)  # every operand with the output's rows
        else:
            rows = [args[0]]
            ndim = val(args[0]).dim() + (t is aten.unsqueeze.default)
            index = 2 if t in DIM_AT_2 else 1
            dims = args[index] if len(args) > index else node.kwargs.get("dim", 0)
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        if not dims or any(d is None or d % ndim == 0 for d in dims):  # no dims: over every dim
            raise NotRowWise(f"{_name(node)} over the leading dim")
        return rows, self._row_factor(rows[0])

    def _sdpa_rule(self, node: fx.Node) -> tuple[list[fx.Node], Any]:
        """q, k, v have the rows (batch leading, independent across it); a mask / bias with their leading
        dim has them too, one with leading dim 1 or a lower rank broadcasts."""
        names = [a.name for a in node.target._schema.arguments]
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        q = bound["query"]
        size, ndim = val(q).shape[0], val(q).dim()
        rows = self._pointwise_rows([bound[n] for n in SDPA_ROWS], size, ndim)
        if len(rows) != 3:
            raise NotRowWise("attention over q / k / v without the rows")
        rows += self._pointwise_rows([bound[n] for n in SDPA_MASKS if bound.get(n) is not None], size, ndim)
        return rows, self._row_factor(q)

    def _check_items(self, node: fx.Node, f: Any) -> None:
        """A split tuple-valued op: each item used must be a tensor with the op's rows (not, say, a seed)."""
        items = val(node)
        for user in node.users:
            if user.target is not operator.getitem:
                raise NotRowWise(f"{_name(node)} whose tuple is used whole")
            item = items[user.args[1]]
            item_f = self._size_factor(item.shape[0]) if isinstance(item, torch.Tensor) and item.dim() else None
            if item_f is None or not same(item_f, f):
                raise NotRowWise(f"{_name(node)} with an output that has no rows")

    def _clone(self, node: fx.Node, k: int, rows: list[fx.Node], f: Any) -> fx.Node:
        """The node computed on subset k's rows: split row operands by their subset, replicated ones sliced."""

        def sub(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in self.halves:
                    return (self.halves[a].a, self.halves[a].b)[k]
                return self._slice(a, k, before=node) if a in rows else a
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        args, kwargs = sub(node.args), {key: sub(v) for key, v in node.kwargs.items()}
        if node.target in VIEW_OPS or (node.target is aten.expand.default and args[1][0] != -1):
            args = (args[0], [self._rows(f, before=node)[k], *args[1][1:]], *args[2:])
        clone = self.edit.insert(node.target, args, kwargs, before=node)
        self.subset[clone] = k
        return clone

    def _rows(self, f: Any, *, before: fx.Node) -> tuple:
        """FX arguments for the leading sizes of a split value of factor f: subset A's f*s, subset B's
        f*(U - s), and the whole f*U (inserted once, before their first use)."""
        key = f.node.expr if isinstance(f, torch.SymInt) else f
        if key not in self.rows_args:
            s, u, rest = self.bounds
            if isinstance(f, int) and f == 1:
                self.rows_args[key] = (s, rest, u)
            else:
                f_arg = self._size_arg(key, before=before)
                self.rows_args[key] = tuple(self._mul(f_arg, x, before=before) for x in (s, rest, u))
        return self.rows_args[key]

    def _mul(self, a: Any, b: Any, *, before: fx.Node) -> Any:
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return a * b
        node = self.edit.insert(operator.mul, (a, b), before=before)
        self.helpers.add(node)
        return node

    def _size_arg(self, expr: Any, *, before: fx.Node) -> Any:
        """An FX argument for a size (sympy expression or int): a SymInt graph input, a graph input's dim, or
        a product of those; NotRowWise if the graph has no way to compute it."""
        if isinstance(expr, int) or (isinstance(expr, sympy.Expr) and expr.is_Integer):
            return int(expr)
        if expr in self.size_args:
            return self.size_args[expr]
        found = None
        for p in self.graph.nodes:
            if p.op != "placeholder":
                break
            v = val(p)
            if isinstance(v, torch.SymInt) and v.node.expr == expr:
                found = p
                break
            if found is None and isinstance(v, torch.Tensor):
                dims = [d for d, n in enumerate(v.shape) if isinstance(n, torch.SymInt) and n.node.expr == expr]
                if dims:
                    found = self.edit.insert(aten.sym_size.int, (p, dims[0]), before=before)
                    self.helpers.add(found)
        if found is None and isinstance(expr, sympy.Mul):
            found = 1
            for term in expr.args:
                found = self._mul(found, self._size_arg(term, before=before), before=before)
        if found is None:
            raise NotRowWise(f"a leading dim of {expr} rows, a size no graph input gives")
        self.size_args[expr] = found
        return found

    def _slice(self, x: fx.Node, k: int, *, before: fx.Node) -> fx.Node:
        """Subset k's rows of a replicated node (a view), one per node and subset."""
        if x not in self.sliced:
            s, _, n = self._rows(self._factor(x), before=before)
            a = self.edit.insert(aten.slice.Tensor, (x, 0, 0, s), before=before)
            b = self.edit.insert(aten.slice.Tensor, (x, 0, s, n), before=before)
            self.subset[a], self.subset[b] = 0, 1
            self.helpers |= {a, b}
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


def schedule(graph: fx.Graph, subset: dict[fx.Node, int], kinds: dict[fx.Node, str] | None = None) -> list[str]:
    """The split graph's matmuls, all-reduce starts and waits in graph order, with their subsets: "mm A", ...
    `kinds`: the kind of nodes SCHEDULE_KINDS does not name (a later pass's starts of a sum)."""
    kinds = kinds or {}
    return [
        f"{kinds.get(n) or SCHEDULE_KINDS[n.target]} {'AB'[subset[n]]}"
        for n in graph.nodes
        if (n in kinds or n.target in SCHEDULE_KINDS) and n in subset
    ]


def _name(node: fx.Node) -> str:
    return str(node.target).removeprefix("aten.")
