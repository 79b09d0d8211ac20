"""Small helpers for rewriting post-grad ATen graphs: insert a node with its fake value, sizes, counts."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

aten = torch.ops.aten
funcol = torch.ops._c10d_functional
tpw = torch.ops.tpweave

CONVERT = torch.ops.prims.convert_element_type.default
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# Ops whose output has the input's shape, element for element (casts, copies, aliases)
SAME_SHAPE_OPS = {
    CONVERT,
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
}

COLLECTIVE_TARGETS = {
    "all_reduce": funcol.all_reduce.default,
    "reduce_scatter_tokens": tpw.reduce_scatter_tokens.default,
    "all_gather_tokens": tpw.all_gather_tokens.default,
    "ag_mm": tpw.ag_mm.default,
    "mm_rs": tpw.mm_rs.default,
    "mm_rs_rms_norm": tpw.mm_rs_rms_norm.default,
    "all_reduce_routed": tpw.all_reduce.default,
    "all_reduce_rms_norm": tpw.all_reduce_rms_norm.default,
    "all_reduce_rms_norm_split": tpw.all_reduce_rms_norm_start.default,
    "all_gather_into_tensor": funcol.all_gather_into_tensor.default,
    "reduce_scatter_tensor": funcol.reduce_scatter_tensor.default,
}


def val(x: Any) -> Any:
    """The fake value (meta['val']) of an FX node, None if it has none; anything else is returned as it is."""
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def is_tensor_node(x: Any) -> bool:
    """Whether x is an FX node whose fake value is a tensor."""
    return isinstance(x, fx.Node) and isinstance(val(x), torch.Tensor)


def same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are known to be equal without adding a guard."""
    return bool(statically_known_true(a == b))


def same_sizes(a: tuple, b: tuple) -> bool:
    """Whether two shapes have the same rank and sizes known to be equal (see `same`)."""
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def prod(sizes) -> Any:
    """Product of the sizes (ints or SymInts); 1 for none."""
    return math.prod(sizes)


def all_reduce_waits(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(wait_tensor, all_reduce) node pairs of the graph's functional all-reduces, in graph order."""
    return [
        (n, n.args[0])
        for n in graph.nodes
        if n.target is funcol.wait_tensor.default and getattr(n.args[0], "target", None) is funcol.all_reduce.default
    ]


def count_collectives(graph: fx.Graph) -> dict[str, int]:
    """Number of nodes per collective kind (the keys of COLLECTIVE_TARGETS) in the graph, sorted by kind."""
    inverse = {v: k for k, v in COLLECTIVE_TARGETS.items()}
    counts = Counter(inverse[n.target] for n in graph.nodes if n.op == "call_function" and n.target in inverse)
    return dict(sorted(counts.items()))


DISPATCHED = {
    tpw.ag_mm.default: "ag_mm",
    tpw.mm_rs.default: "mm_rs",
    tpw.mm_rs_rms_norm.default: "mm_rs_rms_norm",
    tpw.ag_scaled_mm.default: "ag_scaled_mm",
    tpw.scaled_mm_rs.default: "scaled_mm_rs",
    tpw.all_reduce.default: "all_reduce",
    tpw.all_reduce_rms_norm.default: "all_reduce_rms_norm",
}


def dispatched_ops(graph: fx.Graph) -> list[tuple[str, str]]:
    """(kind, policy) of every strategy-dispatched op (ops/dispatched_ops.py) in the graph, in order."""
    out = []
    for n in graph.nodes:
        kind = DISPATCHED.get(n.target) if n.op == "call_function" else None
        if kind is not None:
            names = [a.name for a in n.target._schema.arguments]
            out.append((kind, n.args[names.index("policy")]))
    return out


class GraphEditor:
    """Inserts call_function nodes and fills meta['val'] by running the op on the fake inputs
    (Inductor's later passes fail on nodes without it)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])

    def insert(self, target, args: tuple, kwargs: dict | None = None, *, before: fx.Node) -> fx.Node:
        """Insert target(*args, **kwargs) before `before`, its meta['val'] computed on the inputs' fake values;
        the new node."""
        kwargs = kwargs or {}
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        fargs, fkwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fargs, **fkwargs)
        else:
            node.meta["val"] = target(*fargs, **fkwargs)
        return node

    def size_arg(self, x: fx.Node, dim: int, *, before: fx.Node):
        """An FX argument for x.shape[dim]: the int itself, a SymInt graph input, or a sym_size node.

        Prefer the graph input: a sym_size node would be one more user of x and keep x's buffer alive."""
        size = val(x).shape[dim]
        if isinstance(size, int):
            return size
        for n in self.graph.nodes:
            if n.op != "placeholder":
                break
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt) and v.node.expr == size.node.expr:
                return n
        return self.insert(aten.sym_size.int, (x, dim), before=before)

    def erase_unused(self, candidates: set[fx.Node]) -> None:
        """Erase the nodes of `candidates` that have no users, last first (so a chain of them goes entirely)."""
        for node in reversed(list(self.graph.nodes)):
            if node in candidates and not node.users:
                self.graph.erase_node(node)
