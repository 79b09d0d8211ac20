"""Batch invariance (CompileOptions(invariant="batch" | "tp")): the graph's matmuls and attention ops swapped for the
batch-invariant ones (ops/invariant.py), so each token's logits do not depend on the other tokens of its step.

Before:                                         After:
    y = mm(x, permute(w, [1, 0]))                   y = tpweave.invariant_mm(x, permute(w, [1, 0]))
    y = addmm(b, x, wt)                             y = tpweave.invariant_addmm(b, x, wt, 1, 1)
    r = tpweave.reduce_scatter_tokens(y, ...)       r = tpweave.ordered_reduce_scatter_tokens(y, ...)
    o = tpweave.attention(q, k, v, cu, s)           o = tpweave.invariant_attention(q, k, v, cu, s)
    o = _scaled_dot_product_flash_attention_for_cpu(q, k, v, ...)
                                                    o = tpweave.invariant_sdpa_cpu(q, k, v, ...)
    auto_functionalized_v2(                         auto_functionalized_v2(
        tpweave.paged_attention, ...)                   tpweave.invariant_paged_attention, ...)

Level "tp" (CompileOptions(invariant="tp"): the same bits at TP 1, 2, 4, 8; ops/invariant.py, K_CHUNKS) instead:
    y = mm(x, wt)                                   y = tpweave.tp_invariant_mm(x, wt)
    r = tpweave.all_reduce(mm(x, wt), g, W, p)      r = tpweave.tp_invariant_mm_all_reduce(x, wt, g, W)
    r = tpweave.reduce_scatter_tokens(mm(x, wt), 1, g, W)
                                                    r = tpweave.tp_invariant_mm_reduce_scatter(x, wt, g, W)
(the token-split graph's row-parallel products and their sums are already tpweave.tp_invariant_rank_subtree, an
all-gather and tpweave.ordered_sum_gathered: compiler/allreduce.py order_all_reduces)

The rest of a decoder layer is row-wise (RMSNorm, RoPE, SwiGLU, residual adds): Inductor generates one kernel for
every M (tpweave compiles M as a dynamic size), so a row is reduced the same way whatever M is.

At TP >= 2 every cross-rank sum runs in one fixed order, a tree over the ranks (the plan routes every site to the
`ordered` strategy, and the SP pass's reduce-scatters are swapped here for `tpweave::ordered_reduce_scatter_tokens`):
a row's sum is the same in the plain graph's all-reduce and in the SP graph's reduce-scatter, whatever M. Ops that
reduce across rows or pick kernels per shape and are not tpweave's own (a batched matmul, torch's SDPA on a GPU, a
fused FP8 matmul, a collective that sums in the backend's order) are listed in the report as not invariant; with
strict=True they raise.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tpweave.compiler.report import GraphReport
from tpweave.ops import invariant as _invariant_ops  # noqa: F401  (registers the invariant ops)

aten = torch.ops.aten
tpw = torch.ops.tpweave
AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)

SWAPS = {
    aten.mm.default: tpw.invariant_mm.default,
    tpw.attention.default: tpw.invariant_attention.default,
    tpw.reduce_scatter_tokens.default: tpw.ordered_reduce_scatter_tokens.default,
    # torch's SDPA on a CPU (e.g. a Hugging Face model's attention)
    aten._scaled_dot_product_flash_attention_for_cpu.default: tpw.invariant_sdpa_cpu.default,
}
MUTABLE_SWAPS = {tpw.paged_attention.default: tpw.invariant_paged_attention.default}
# ops whose result for a row may depend on the other rows of the call, that this pass cannot swap
NOT_INVARIANT = {
    aten.bmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


class NotInvariant(RuntimeError):
    """A graph compiled with invariant set and strict=True holds an op the pass cannot make invariant."""


def make_batch_invariant(graph: fx.Graph, *, report: GraphReport, strict: bool, level: str = "batch") -> None:
    """Swap the graph's matmuls and attention ops for the invariant ones (module doc), in place; what was swapped and
    what could not be goes into the report. level "tp": the matmuls as tree products over K chunks, a row-parallel
    product and its all-reduce or reduce-scatter as one op (ops/invariant.py, K_CHUNKS)."""
    swapped: dict[str, int] = {}
    left: dict[str, int] = {}
    tp = level == "tp"
    if tp:
        for name, count in _fuse_row_parallel(graph).items():
            swapped[name] = count
        # the token-split graph's, already in place (compiler/allreduce.py order_all_reduces)
        subtrees = sum(n.target is tpw.tp_invariant_rank_subtree.default for n in graph.nodes)
        if subtrees:
            swapped["mm + all_reduce as fp32 subtrees all-gathered"] = subtrees
    swaps = {**SWAPS, aten.mm.default: tpw.tp_invariant_mm.default} if tp else SWAPS
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in swaps:
            node.target = swaps[target]
        elif target is aten.addmm.default:
            bias, a, b = node.args[:3]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            node.target = tpw.tp_invariant_addmm.default if tp else tpw.invariant_addmm.default
            node.args, node.kwargs = (bias, a, b, float(beta), float(alpha)), {}
        elif target in AUTO_FUNCTIONALIZED and node.args and node.args[0] in MUTABLE_SWAPS:
            target = node.args[0]
            node.args = (MUTABLE_SWAPS[target], *node.args[1:])
        elif target in NOT_INVARIANT or _unordered_collective(node):
            name = str(target)
            left[name] = left.get(name, 0) + 1
            continue
        else:
            continue
        swapped[str(target)] = swapped.get(str(target), 0) + 1
    report.invariant = {"swapped": swapped, "not_invariant": left}
    if left:
        msg = "not batch-invariant: " + ", ".join(f"{n} x{c}" for n, c in sorted(left.items()))
        if strict:
            raise NotInvariant(msg)
        report.notes.append(msg)


ROW_PARALLEL_FUSIONS = {
    tpw.all_reduce.default: tpw.tp_invariant_mm_all_reduce.default,  # (x, group_name, world_size, policy)
    tpw.reduce_scatter_tokens.default: tpw.tp_invariant_mm_reduce_scatter.default,  # (x, 1, group_name, world_size)
}


def _fuse_row_parallel(graph: fx.Graph) -> dict[str, int]:
    """level "tp": mm(a, b) read only by an all-reduce or a reduce-scatter over tokens becomes one op that sums the
    ranks' K-chunk subtrees in the TP=1 product's tree. {what was fused: count}."""
    fused: dict[str, int] = {}
    for node in list(graph.nodes):
        if node.target is not aten.mm.default or len(node.users) != 1:
            continue
        user = next(iter(node.users))
        if user.target not in ROW_PARALLEL_FUSIONS or user.args[0] is not node:
            continue
        if user.target is tpw.all_reduce.default:
            group_name, world_size = user.args[1], user.args[2]
        elif user.args[1] == 1:
            group_name, world_size = user.args[2], user.args[3]
        else:
            continue
        name = f"mm + {user.target}"
        user.target = ROW_PARALLEL_FUSIONS[user.target]
        user.args, user.kwargs = (*node.args, group_name, world_size), {}
        graph.erase_node(node)
        fused[name] = fused.get(name, 0) + 1
    return fused


def _unordered_collective(node: fx.Node) -> bool:
    """A collective that sums across ranks in an order of the backend's (its size decides where each row's sum
    starts), or a strategy-dispatched op whose policy is not `ordered` (ops/strategies/ordered.py)."""
    name = str(node.target)
    if name.startswith(("_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter")):
        return True
    schema = getattr(node.target, "_schema", None)
    if not name.startswith("tpweave.") or schema is None:
        return False
    names = [a.name for a in schema.arguments]
    if "policy" in names:
        i = names.index("policy")
        policy = node.args[i] if i < len(node.args) else node.kwargs.get("policy")
        return policy != "ordered"
    return "num_sms" in names  # the token split's side-stream all-reduce + norm: no policy, never ordered
