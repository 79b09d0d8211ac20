"""Sequence-parallel pass: propagate a token-sharded placement through the post-grad ATen graph.

Placements: a node is either replicated (the default: the graph as written) or `Shard`: this rank
holds rows [rank*r, (rank+1)*r) of its tokens flattened, r = shard_rows(N) = max(ceil(N/TP), 2),
as the node `local`.
- all_reduce(sum) -> reduce_scatter_tokens: the result is a Shard.
- token-wise ops (pointwise, casts, reductions/softmax/norms over feature dims, views, slices and
  expands that keep the token dims leading) run on the Shard; a replicated activation of the same tokens
  that meets a Shard is sliced locally (no communication).
- a matmul whose rows are a Shard's (mm(x, W), addmm(b, x, W); W not sharded) runs on the Shard where every
  reader of its product takes it token-wise until it meets a value already sharded: a replicated linear whose
  product only weighs the sharded stream (a hyper-connection's mixing weights from the flattened streams) moves
  no tokens. Where a reader needs all tokens (attention after a column-parallel projection, a row-parallel
  product's all-reduce, a router's top-k) the input is gathered first instead, so async TP fuses the gather.
- any other consumer (matmuls, attention, graph outputs, ops we do not know) gets one
  all_gather_tokens per Shard node, inserted right before the first consumer and shared by all.
Nothing is guessed: an op that is not known to be token-wise gathers first and the report says so.

A replicated linear over the flattened streams, before and after (T tokens, r = T/TP rows a rank, n streams):
    s = reduce_scatter_tokens(...)               (r, H)         s = reduce_scatter_tokens(...)   (r, H)
    f = view(expand(s), [T, n*H])                (T, n*H)       f = view(expand(s), [r, n*H])   (r, n*H)
    g = all_gather_tokens(f)                     (T, n*H)
    w = mm(g, W)                                 (T, n)         w = mm(f, W)                    (r, n)
    y = mul(shard_tokens(w), ...)                (r, n)         y = mul(w, ...)                 (r, n)
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
    prod,
    same,
    same_sizes,
    tpw,
    val,
)
from tpweave.compiler.report import GraphReport
from tpweave.compiler.tp_group import TPGroup

# Consumers that need every token by nature: gathering before them is the plan, not a fallback.
FULL_CONSUMERS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    tpw.scaled_mm.default,
    tpw.attention.default,
    tpw.paged_attention.default,
    funcol.all_gather_into_tensor.default,
    aten.index.Tensor,  # e.g. picking the last token of each sequence for the LM head
    tpw.select_rows.default,
    aten.index_select.default,
    aten.gather.default,
    aten.embedding.default,
}

REDUCTIONS = {
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.amax.default,
    aten.amin.default,
    aten.var_mean.correction,
    aten.var.correction,
}
SOFTMAXES = {aten._softmax.default, aten._log_softmax.default}
NORMS = {aten.native_layer_norm.default, aten._fused_rms_norm.default}
DIM_OPS = {
    aten.unsqueeze.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.squeeze.dim,
    aten.permute.default,
    aten.expand.default,
    aten.cat.default,
}
# matmuls whose output rows are one operand's rows (the operand's index): row-wise in that operand
ROW_PRODUCTS = {aten.mm.default: 0, aten.addmm.default: 1}
# how far the search for a reader that needs all tokens follows a product's readers before it assumes one does
_READER_DEPTH = 64


def _may_be_token_wise(node: fx.Node) -> bool:
    """Whether a rule of the pass may keep `node` sharded (its operands' placements decide)."""
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return (
        torch.Tag.pointwise in t.tags
        or t in SAME_SHAPE_OPS
        or t in REDUCTIONS
        or t in SOFTMAXES
        or t in NORMS
        or t in VIEW_OPS
        or t in DIM_OPS
    )


@dataclass
class Shard:
    """A token-sharded node: `local` holds this rank's rows of the flattened token dims, `token_sizes` the
    logical token dims (FX arguments) of the replicated value."""

    local: fx.Node  # this rank's rows, shape (shard_rows(N), *features) (or a tuple of such)
    token_sizes: list  # FX args (ints / SymInt nodes) of the logical token dims, N = their product

    @property
    def num_token_dims(self) -> int:
        """Number of leading token dims of the replicated value."""
        return len(self.token_sizes)


class NotTokenWise(Exception):
    """The op is not known to be token-wise on a Shard; the message says why."""

    pass


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class SequenceParallelPass:
    """Rewrites one graph in place by the rules of the module docstring, adding every site to `report`."""

    def __init__(self, graph: fx.Graph, cfg: TPGroup, report: GraphReport):
        self.graph, self.cfg, self.report = graph, cfg, report
        self.edit = GraphEditor(graph)
        self.shards: dict[fx.Node, Shard] = {}
        self.gathered: dict[tuple, fx.Node] = {}  # (local node, token sizes) -> replicated node
        self.replaced: set[fx.Node] = set()
        # token dims of the first all-reduce made a reduce-scatter (1 for packed tokens, 2 for (batch, seq)): which
        # layout a view to leading size-1 dims means, where the sizes alone cannot tell (one token: [1, X] to [1, 1, X])
        self.model_token_dims: int | None = None
        self.from_reduce_scatters: set[fx.Node] = set()  # set by run(): nodes the rules may shard without a product
        self.reads_whole: dict[fx.Node, bool] = {}  # memo of _read_whole

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> None:
        """Visit every node in graph order, gather the Shards the graph outputs, then erase the replaced nodes."""
        self.from_reduce_scatters = self._reachable_token_wise(
            [n for n in self.graph.nodes if n.target is funcol.wait_tensor.default and self._is_all_reduce(n.args[0])]
        )
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._gather_inputs(node, why="graph output")
            elif node.op == "call_function":
                self.visit(node)
        self.edit.erase_unused(self.replaced)

    def visit(self, node: fx.Node) -> None:
        """Apply the rules to one node: a TP all-reduce becomes a reduce-scatter, a token-wise op on a Shard
        stays sharded, any other reader of a Shard gets its inputs gathered first."""
        if node.target is funcol.wait_tensor.default and self._is_all_reduce(node.args[0]):
            self._all_reduce(node)
            return
        if not any(a in self.shards for a in node.all_input_nodes):
            return
        if node.target in ROW_PRODUCTS and self._local_product(node):
            return
        try:
            shard = self._token_wise(node)
        except NotTokenWise as e:
            reason = str(e)
            if node.target in FULL_CONSUMERS or node.target is funcol.all_reduce.default:
                self._gather_inputs(node, why=f"{_op_name(node)} needs all tokens")
            else:
                self._gather_inputs(node, why=f"unknown op {_op_name(node)}: gathered first ({reason})", unknown=True)
            return
        self.shards[node] = shard
        self.replaced.add(node)

    # ---- all_reduce -> reduce_scatter ---------------------------------------------------------
    def _is_all_reduce(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and node.target is funcol.all_reduce.default

    def _all_reduce(self, wait: fx.Node) -> None:
        ar = wait.args[0]
        x, reduce_op, group_name = ar.args[:3]
        x_val = val(x)
        why = None
        if reduce_op != "sum":
            why = f"reduce op {reduce_op!r} is not a sum"
        elif group_name != self.cfg.group_name:
            why = f"group {group_name!r} is not the TP group {self.cfg.group_name!r}"
        elif x_val.dim() < 2:
            why = "a 1-D tensor has no token dim to shard"
        elif len(ar.users) != 1:
            why = "the un-waited all_reduce has other users"
        if why:
            self.report.add("all_reduce", ar, "left alone", why)
            if x in self.shards:
                self._gather_inputs(ar, why="input of an all_reduce left alone")
            return
        if x in self.shards:
            self._gather_inputs(ar, why="all_reduce of a sharded tensor")
            x = ar.args[0]
        k = x_val.dim() - 1  # every dim but the hidden one is a token dim
        token_sizes = [self.edit.size_arg(x, d, before=wait) for d in range(k)]
        rs = self.edit.insert(
            tpw.reduce_scatter_tokens.default, (x, k, self.cfg.group_name, self.cfg.world_size), before=wait
        )
        if self.model_token_dims is None:
            self.model_token_dims = k
        self.shards[wait] = Shard(rs, token_sizes)
        self.replaced |= {wait, ar}
        self.report.add(
            "all_reduce",
            ar,
            "sequence-parallel",
            "reduce_scatter_tokens; token-wise ops after it on 1/TP of the tokens",
        )

    # ---- products on the shard ----------------------------------------------------------------
    def _reachable_token_wise(self, roots: list[fx.Node]) -> set[fx.Node]:
        """The roots and every node reached from them through readers a token-wise rule may keep sharded."""
        seen: set[fx.Node] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(u for u in n.users if _may_be_token_wise(u))
        return seen

    def _local_product(self, node: fx.Node) -> bool:
        """Run a matmul on the Shard of its row operand (its rows are the tokens, its other operands not sharded)
        where no reader of the product needs all tokens; False to leave it to the gather."""
        i = ROW_PRODUCTS[node.target]
        x = node.args[i]
        if not (isinstance(x, fx.Node) and x in self.shards) or self.shards[x].num_token_dims != 1:
            return False
        if any(a in self.shards for a in node.all_input_nodes if a is not x) or x in node.args[i + 1 :]:
            return False
        if isinstance(val(self.shards[x].local), (tuple, list)) or self._read_whole(node, 0):
            return False
        sh = self.shards[x]
        args = list(node.args)
        args[i] = sh.local
        self.shards[node] = self._replace(node, tuple(args), sh.token_sizes)
        self.replaced.add(node)
        self.report.add(
            "matmul",
            node,
            "sequence-parallel",
            "rows of a sharded input; every reader takes the product token-wise: on 1/TP of the tokens, no gather",
        )
        return True

    def _read_whole(self, node: fx.Node, depth: int) -> bool:
        """Whether a reader of `node`, were it sharded, would need all its tokens: a graph output, a matmul's other
        operand, attention, an all-reduce, an op no rule keeps sharded, found through token-wise readers and
        row-wise products up to the first reader the rules shard anyway (one that meets a reduce-scattered value)."""
        if node in self.reads_whole:
            return self.reads_whole[node]
        whole = depth > _READER_DEPTH
        for u in node.users if not whole else ():
            if u in self.from_reduce_scatters:
                continue  # sharded without this product too: the readers after it are as they were
            row_operand = u.args[ROW_PRODUCTS[u.target]] if u.target in ROW_PRODUCTS else None
            if u.op == "output" or not (row_operand is node or _may_be_token_wise(u)):
                whole = True
            elif row_operand is node and any(a is node for a in u.args[ROW_PRODUCTS[u.target] + 1 :]):
                whole = True
            else:
                whole = self._read_whole(u, depth + 1)
            if whole:
                break
        self.reads_whole[node] = whole
        return whole

    # ---- gathers ------------------------------------------------------------------------------
    def _full(self, node: fx.Node, *, before: fx.Node) -> fx.Node:
        """The replicated value of a Shard node: one all_gather per local tensor, shared by every
        consumer; a consumer that sees other token dims (B, S vs B*S) gets a view of that gather."""
        sh = self.shards[node]
        if isinstance(val(node), (tuple, list)):
            raise NotImplementedError(f"a consumer needs all tokens of the tuple-valued {node.name}: not supported")
        key = (sh.local, tuple(sh.token_sizes))
        if key in self.gathered:
            return self.gathered[key]
        first = next((g for (local, _), g in self.gathered.items() if local is sh.local), None)
        if first is None:
            args = (sh.local, sh.token_sizes, self.cfg.group_name, self.cfg.world_size)
            full = self.edit.insert(tpw.all_gather_tokens.default, args, before=before)
        else:
            feats = list(val(sh.local).shape[1:])
            full = self.edit.insert(aten.view.default, (first, [*sh.token_sizes, *feats]), before=before)
        self.gathered[key] = full
        return full

    def _gather_inputs(self, node: fx.Node, *, why: str, unknown: bool = False) -> None:
        for inp in list(node.all_input_nodes):
            if inp in self.shards:
                first = not any(local is self.shards[inp].local for local, _ in self.gathered)
                full = self._full(inp, before=node)
                node.replace_input_with(inp, full)
                if first:
                    self.report.add(
                        "all_gather", full, "inserted", f"for {why}" + (f" of {inp.name}" if unknown else "")
                    )
                if unknown:
                    self.report.notes.append(f"{node.name}: {why}")

    # ---- token-wise rules ---------------------------------------------------------------------
    def _token_wise(self, node: fx.Node) -> Shard:
        t = node.target
        if t is operator.getitem:
            return self._getitem(node)
        if not isinstance(t, torch._ops.OpOverload):
            raise NotTokenWise("not an ATen op")
        for v in node.kwargs.values():
            if isinstance(v, fx.Node) and v in self.shards:
                raise NotTokenWise("sharded keyword argument")
        if torch.Tag.pointwise in t.tags or t in SAME_SHAPE_OPS:
            return self._pointwise(node)
        if t in REDUCTIONS or t in SOFTMAXES:
            return self._reduction(node)
        if t in NORMS:
            return self._norm(node)
        if t in VIEW_OPS:
            return self._view(node)
        if t is aten.unsqueeze.default:
            return self._dim_op(node, out_ndim=val(node).dim())
        if t in (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.squeeze.dim):
            return self._dim_op(node, out_ndim=val(node.args[0]).dim())
        if t is aten.permute.default:
            return self._permute(node)
        if t is aten.expand.default:
            return self._expand(node)
        if t is aten.cat.default:
            return self._cat(node)
        raise NotTokenWise("no token-wise rule")

    def _input_shard(self, node: fx.Node) -> tuple[fx.Node, Shard]:
        x = node.args[0]
        if not (isinstance(x, fx.Node) and x in self.shards):
            raise NotTokenWise("first argument is not the sharded tensor")
        for a in node.all_input_nodes[1:]:
            if a in self.shards and a is not x:
                raise NotTokenWise("several sharded inputs")
        return x, self.shards[x]

    def _replace(self, node: fx.Node, args: tuple, token_sizes: list, kwargs: dict | None = None) -> Shard:
        new = self.edit.insert(node.target, args, node.kwargs if kwargs is None else kwargs, before=node)
        return Shard(new, token_sizes)

    def _getitem(self, node: fx.Node) -> Shard:
        src, idx = node.args
        sh = self.shards[src]
        if not isinstance(val(src), (tuple, list)):
            raise NotTokenWise("getitem on a tensor")
        return self._replace(node, (sh.local, idx), sh.token_sizes)

    def _pointwise(self, node: fx.Node) -> Shard:
        out = val(node)
        sharded = [a for a in node.all_input_nodes if a in self.shards]
        ref = self.shards[sharded[0]]
        k = ref.num_token_dims
        tokens = val(sharded[0]).shape[:k]
        if not isinstance(out, torch.Tensor) or out.dim() < k or not same_sizes(out.shape[:k], tokens):
            raise NotTokenWise("output does not keep the token dims")
        for s in sharded:
            sv = val(s)
            if self.shards[s].num_token_dims != k or sv.dim() != out.dim() or not same_sizes(sv.shape[:k], tokens):
                raise NotTokenWise("sharded inputs with different token layouts")
        num_features = out.dim() - k

        def local(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if a in self.shards:
                return self.shards[a].local
            if not is_tensor_node(a):
                return a
            av = val(a)
            if av.dim() <= num_features:
                return a  # broadcasts over tokens only (a per-hidden weight, a scalar tensor)
            lead = av.shape[: av.dim() - num_features]
            if av.dim() == out.dim() and same_sizes(lead, tokens):
                # A replicated activation of the same tokens meets the shard: slice it here, for free. Checked
                # before the size-1 broadcast below: with one token the two look alike, and the slice keeps
                # the shard's row count (padded to shard_rows), so later rewrites see equal shapes.
                sliced = self.edit.insert(
                    tpw.shard_tokens.default, (a, k, self.cfg.rank, self.cfg.world_size), before=node
                )
                self.report.add(
                    "replicated->shard", a, "sliced locally", f"meets sharded {sharded[0].name} in {node.name}"
                )
                return sliced
            if all(same(s, 1) for s in lead):
                feats = av.shape[av.dim() - num_features :]
                if not all(isinstance(s, int) for s in feats):
                    raise NotTokenWise("broadcast operand with symbolic feature dims")
                return self.edit.insert(aten.view.default, (a, [1, *feats]), before=node)
            raise NotTokenWise(f"operand {a.name} broadcasts over some token dims")

        args = tuple(_map_args(node.args, local))
        kwargs = dict(node.kwargs)
        return self._replace(node, args, ref.token_sizes, kwargs)

    def _reduction(self, node: fx.Node) -> Shard:
        x, sh = self._input_shard(node)
        ndim, k = val(x).dim(), sh.num_token_dims
        args, kwargs = list(node.args), dict(node.kwargs)
        if node.target in SOFTMAXES:
            dims, where = [args[1]], "softmax"
        elif len(args) > 1:
            dims, where = args[1], "args"
        else:
            dims, where = kwargs.get("dim"), "kwargs"
        if dims is None:
            raise NotTokenWise("reduction over all dims")
        dims = [dims] if isinstance(dims, int) else list(dims)
        local_dims = []
        for d in dims:
            dn = _norm_dim(d, ndim)
            if dn < k:
                raise NotTokenWise("reduces over a token dim")
            local_dims.append(dn - k + 1)
        if where == "softmax":
            args[1] = local_dims[0]
        elif where == "args":
            args[1] = local_dims
        else:
            kwargs["dim"] = local_dims
        args[0] = sh.local
        return self._replace(node, tuple(args), sh.token_sizes, kwargs)

    def _norm(self, node: fx.Node) -> Shard:
        x, sh = self._input_shard(node)
        if len(node.args[1]) > val(x).dim() - sh.num_token_dims:
            raise NotTokenWise("normalizes over token dims")
        return self._replace(node, (sh.local, *node.args[1:]), sh.token_sizes)

    def _dim_op(self, node: fx.Node, *, out_ndim: int) -> Shard:
        """unsqueeze/squeeze/slice/split: one `dim` argument that must be a feature dim."""
        x, sh = self._input_shard(node)
        k = sh.num_token_dims
        args = list(node.args)
        if node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            pos = 2
            dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        else:
            pos = 1
            dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        dn = _norm_dim(dim, out_ndim)
        if dn < k:
            raise NotTokenWise("acts on a token dim")
        kwargs = dict(node.kwargs)
        kwargs.pop("dim", None)
        while len(args) <= pos:
            args.append(None)
        args[0], args[pos] = sh.local, dn - k + 1
        if node.target is aten.slice.Tensor and args[2] is None:
            args = args[:2]
        return self._replace(node, tuple(args), sh.token_sizes, kwargs)

    def _permute(self, node: fx.Node) -> Shard:
        x, sh = self._input_shard(node)
        k, ndim = sh.num_token_dims, val(x).dim()
        dims = [_norm_dim(d, ndim) for d in node.args[1]]
        if dims[:k] != list(range(k)):
            raise NotTokenWise("moves a token dim")
        return self._replace(node, (sh.local, [0] + [d - k + 1 for d in dims[k:]]), sh.token_sizes)

    def _expand(self, node: fx.Node) -> Shard:
        """expand of feature dims only (e.g. a residual copied into several streams: (T, 1, H) -> (T, n, H))."""
        x, sh = self._input_shard(node)
        k = sh.num_token_dims
        in_shape, out_shape = val(x).shape, val(node).shape
        if len(out_shape) != len(in_shape) or not same_sizes(out_shape[:k], in_shape[:k]):
            raise NotTokenWise("expands a token dim or adds leading dims")
        feats = list(out_shape[k:])
        if not all(isinstance(f, int) for f in feats):
            raise NotTokenWise("expand with symbolic feature dims")
        return self._replace(node, (sh.local, [-1, *feats]), sh.token_sizes, {})

    def _cat(self, node: fx.Node) -> Shard:
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not all(isinstance(t, fx.Node) and t in self.shards for t in tensors):
            raise NotTokenWise("cat of sharded and replicated tensors")
        sh = self.shards[tensors[0]]
        k, ndim = sh.num_token_dims, val(node).dim()
        for t in tensors:
            if self.shards[t].num_token_dims != k or not same_sizes(val(t).shape[:k], val(tensors[0]).shape[:k]):
                raise NotTokenWise("cat of different token layouts")
        dn = _norm_dim(dim, ndim)
        if dn < k:
            raise NotTokenWise("cat along a token dim")
        return self._replace(node, ([self.shards[t].local for t in tensors], dn - k + 1), sh.token_sizes, {})

    def _view(self, node: fx.Node) -> Shard:
        x, sh = self._input_shard(node)
        k = sh.num_token_dims
        in_shape, out_shape = val(x).shape, val(node).shape
        num_tokens = prod(in_shape[:k])
        # the token dims' count j: out_shape[:j] holds the tokens; several j do where size-1 dims follow them (one
        # token per sequence, or one token in all), and the model's own layout, where one of them, is the one meant
        fits = [j for j in range(1, len(out_shape) + 1) if same(prod(out_shape[:j]), num_tokens)]
        if not fits:
            raise NotTokenWise("view mixes token and feature dims")
        j = self.model_token_dims if self.model_token_dims in fits else fits[0]
        feats = list(out_shape[j:])
        if not all(isinstance(f, int) for f in feats):
            raise NotTokenWise("view with symbolic feature dims")
        if j == k and same_sizes(out_shape[:j], in_shape[:k]):
            token_sizes = sh.token_sizes
        else:
            token_sizes = list(node.args[1][:j])
            inferred = [i for i, s in enumerate(token_sizes) if isinstance(s, int) and s == -1]
            for i in inferred:  # view(-1, H): the -1 is the tokens' count over the other token dims
                if isinstance(out_shape[i], int):
                    token_sizes[i] = out_shape[i]
                else:
                    others = token_sizes[:i] + token_sizes[i + 1 :]
                    token_sizes[i] = self._size_op(
                        operator.floordiv,
                        self._size_op(operator.mul, *sh.token_sizes, before=node),
                        self._size_op(operator.mul, 1, *others, before=node),
                        before=node,
                    )
        if same_sizes(tuple(feats), tuple(val(sh.local).shape[1:])):
            return Shard(sh.local, token_sizes)  # only the token dims change: the local tensor is the same
        rows = self.edit.size_arg(sh.local, 0, before=node)
        return self._replace(node, (sh.local, [rows, *feats]), token_sizes)

    def _size_op(self, op, first, *rest, before: fx.Node):
        """op folded over size arguments (ints, SymInt nodes): ints fold here, the rest become sym nodes."""
        out = first
        for s in rest:
            if isinstance(out, int) and isinstance(s, int):
                out = op(out, s)
            elif op is operator.mul and isinstance(out, int) and out == 1:
                out = s
            elif not (isinstance(s, int) and s == 1):
                out = self.edit.insert(op, (out, s), before=before)
        return out


def _map_args(args, fn):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield type(a)(fn(b) for b in a)
        else:
            yield fn(a)


def _op_name(node: fx.Node) -> str:
    t = node.target
    return (
        getattr(t, "__name__", None)
        if not hasattr(t, "_schema")
        else str(t._schema.name) + (f".{t._overloadname}" if t._overloadname != "default" else "")
    )
