"""Batch invariance (CompileOptions(invariant="batch" | "tp")): the graph's matmuls and attention ops swapped for the
batch-invariant ones (ops/invariant.py), so each token's logits do not depend on the other tokens of its step.

Before:                                         After:
    y = mm(x, permute(w, [1, 0]))                   y = tpweave.invariant_mm(x, permute(w, [1, 0]))
    y = addmm(b, x, wt)                             y = tpweave.invariant_addmm(b, x, wt, 1, 1)
    s = bmm(q_BMK, k_BKN)                           s = tpweave.invariant_bmm(q_BMK, k_BKN)
    s = baddbmm(bias, q, k, beta=b, alpha=a)        s = tpweave.invariant_baddbmm(bias, q, k, b, a)
        (a Hugging Face model's eager attention: torch.matmul is bmm by now; K in fixed chunks, so the product over a
        right-padded key length, its padding probabilities exact zeros, is the product over the sequence's own keys)
    a = mul(silu(gate), up)                         y = tpweave.invariant_gated_mm(gu, permute(w, [1, 0]))
    y = mm(a, permute(w, [1, 0]))
        (gate, up the halves of one (M, 2K) tensor gu, on CUDA: a SwiGLU MLP's down projection, compiler/
        decode_gemv.py's match; the activation by the default mode's kernel, which Inductor's generated one for a
        dynamic M trailed at 64 and 256 rows on one H200: 3.1 against 2.2 and 8.2 against 5.9 us a layer)
    y = _grouped_mm(x, w_GKN, offs)                 y = tpweave.invariant_grouped_mm(x, w_GKN, offs, False)
        (or transformers.grouped_mm_fallback: a mixture of experts' experts, each group through the row tiles)
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
A batched matmul keeps its batch form at this level: attention's (heads sharded, K = head dim or key length whole
on every rank) is no row-parallel product; one whose product a sum over ranks reads is listed as not invariant.

The rest of a decoder layer is row-wise (RMSNorm, RoPE, the SwiGLU activations not swapped above, residual adds):
Inductor generates one kernel for every M (tpweave compiles M as a dynamic size), so a row is reduced the same way
whatever M is.

At TP >= 2 every cross-rank sum runs in one fixed order, a tree over the ranks (the plan routes every site to the
`ordered` strategy, and the SP pass's reduce-scatters are swapped here for `tpweave::ordered_reduce_scatter_tokens`):
a row's sum is the same in the plain graph's all-reduce and in the SP graph's reduce-scatter, whatever M. Ops that
reduce across rows or pick kernels per shape and are not tpweave's own (a matrix-vector product, torch's SDPA on a
GPU, a fused FP8 matmul, a collective that sums in the backend's order), and every op of another library or
higher-order op the pass does not know (what it does across rows is unknown: a mixture of experts' grouped matmul is
batch-dependent) are listed in the report as not invariant; with strict=True they raise.

A sum over a concatenation's dim (through pointwise ops whose other operands broadcast along it) sums each part
on its own, then the parts in order: a softmax over attention scores with a sink logit appended (gpt-oss, HY-V4) has
the sink after the batch's key padding, so a fused sum over the whole row would put the sink elsewhere in its order
at every padded length; each part's padding is trailing (exact zeros, as above).
    c = cat([scores, sink], -1)                     c = cat([scores, sink], -1); m = amax(c)  (as before)
    e = exp(c - m)                                  e_0 = exp(c[..., :T] - m); e_1 = exp(c[..., T:] - m)
    z = sum(e, [-1], True)                          z = sum(e_0, [-1], True) + sum(e_1, [-1], True)

A product of two complex tensors on a CPU (a rotary embedding by complex multiplication: Meta's Llama code,
DeepSeek-V2, Llama 4) is written out in real arithmetic. Inductor does not generate code for complex ops, and ATen's
CPU kernel rounds the elements of its vector loop otherwise than those of its scalar tail: an element's bits depended
on where the tensor's length put it (found on AVX-512; on a GPU every element goes through one function).
    p = mul(a, b)   (complex)                       ar = view_as_real(a); br = view_as_real(b)
                                                    re = ar[..., 0] * br[..., 0] - ar[..., 1] * br[..., 1]
                                                    im = ar[..., 0] * br[..., 1] + ar[..., 1] * br[..., 0]
                                                    p = view_as_complex(cat([re[..., None], im[..., None]], -1))

A token dim of size 1 gets a graph of its own; Inductor reduces its one row as the other graphs do their rows under
the config patches CompileOptions.inductor_config adds in this mode (compiler/options.py _ONE_ROW_AS_MANY).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tpweave.compiler.decode_gemv import between, gated_input
from tpweave.compiler.graph_utils import SAME_SHAPE_OPS, VIEW_OPS, GraphEditor, same, val
from tpweave.compiler.report import GraphReport
from tpweave.ops import fp8 as _fp8_ops  # noqa: F401  (registers tpweave::scaled_mm)
from tpweave.ops import invariant as _invariant_ops  # noqa: F401  (registers the invariant ops)
from tpweave.ops.strategies.ordered import BY_LEVEL

aten = torch.ops.aten
tpw = torch.ops.tpweave
AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)

SWAPS = {
    aten.mm.default: tpw.invariant_mm.default,
    aten.bmm.default: tpw.invariant_bmm.default,
    tpw.attention.default: tpw.invariant_attention.default,
    tpw.reduce_scatter_tokens.default: tpw.ordered_reduce_scatter_tokens.default,
    # torch's SDPA on a CPU (e.g. a Hugging Face model's attention)
    aten._scaled_dot_product_flash_attention_for_cpu.default: tpw.invariant_sdpa_cpu.default,
}
MUTABLE_SWAPS = {tpw.paged_attention.default: tpw.invariant_paged_attention.default}
# ops whose result for a row may depend on the other rows of the call, that this pass cannot swap
NOT_INVARIANT = {
    aten.mv.default,
    aten._scaled_mm.default,
    aten._grouped_mm.default,  # where _grouped_mm_args does not take it (a bias, another output dtype)
    aten._scaled_grouped_mm.default,
    tpw.scaled_mm.default,  # an FP8 model's matmul (ops/fp8.py): torch._scaled_mm, whose kernel depends on the shape
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


def decompositions() -> dict:
    """Inductor's decomposition table without its matmul decompositions, for this mode's compiles. Inductor turns some
    matmuls of size-1 dims into a multiply and a sum (on the CPU a bmm of one row by one column: a one-token prompt's
    attention score), which the pass would not see as matmuls: the row would be reduced otherwise than among others."""
    from torch._inductor.decomposition import select_decomp_table

    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    return {op: fn for op, fn in select_decomp_table().items() if getattr(op, "overloadpacket", None) not in matmuls}


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
        for node in _unfused_product_sums(graph):
            name = f"{node.target} of a matmul's product (tp level: not summed in the product's tree)"
            left[name] = left.get(name, 0) + 1
        # the token-split graph's, already in place (compiler/allreduce.py order_all_reduces)
        subtrees = sum(n.target is tpw.tp_invariant_rank_subtree.default for n in graph.nodes)
        if subtrees:
            swapped["mm + all_reduce as fp32 subtrees all-gathered"] = subtrees
    else:
        gated = _gate_products(graph)
        if gated:
            swapped["silu(gate) * up + mm"] = gated
    complex_products = _real_complex_products(graph)
    if complex_products:
        swapped["complex mul on a CPU: in real arithmetic"] = complex_products
    split = _split_sums_over_cats(graph)
    if split:
        swapped["sum over a concatenation: each part's sum, then the parts in order"] = split
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
        elif target is aten.baddbmm.default:
            bias, a, b = node.args[:3]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            node.target = tpw.invariant_baddbmm.default
            node.args, node.kwargs = (bias, a, b, float(beta), float(alpha)), {}
        elif (grouped := _grouped_mm_args(node)) is not None:
            node.target = tpw.invariant_grouped_mm.default
            node.args, node.kwargs = (*grouped, tp), {}
            node.meta.pop("eager_input_vals", None)  # the custom op's inputs, by its own schema: not this op's
        elif target in AUTO_FUNCTIONALIZED and node.args and node.args[0] in MUTABLE_SWAPS:
            target = node.args[0]
            node.args = (MUTABLE_SWAPS[target], *node.args[1:])
        elif target in NOT_INVARIANT or _unordered_collective(node, level):
            name = str(target)
            left[name] = left.get(name, 0) + 1
            continue
        elif (foreign := _foreign_op(node)) is not None:
            name = f"{foreign} (not tpweave's nor torch's: not known to be invariant)"
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


def _real_complex_products(graph: fx.Graph) -> int:
    """Each product of two complex CPU tensors written out in real arithmetic (module doc); how many."""
    edit = GraphEditor(graph)
    done = 0
    for node in list(graph.nodes):
        if node.target is not aten.mul.Tensor or len(node.args) != 2:
            continue
        a, b = node.args
        va, vb = val(a), val(b)
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and isinstance(a, fx.Node)):
            continue
        if not (va.is_complex() and vb.is_complex() and va.device.type == "cpu" and va.dtype == vb.dtype):
            continue

        def parts(x: fx.Node) -> tuple[fx.Node, fx.Node]:
            r = edit.insert(aten.view_as_real.default, (x,), before=node)
            return tuple(edit.insert(aten.select.int, (r, -1, i), before=node) for i in (0, 1))

        def op(target, x, y):
            return edit.insert(target, (x, y), before=node)

        (ar, ai), (br, bi) = parts(a), parts(b)
        re = op(aten.sub.Tensor, op(aten.mul.Tensor, ar, br), op(aten.mul.Tensor, ai, bi))
        im = op(aten.add.Tensor, op(aten.mul.Tensor, ar, bi), op(aten.mul.Tensor, ai, br))
        halves = [edit.insert(aten.unsqueeze.default, (x, -1), before=node) for x in (re, im)]
        pair = edit.insert(aten.cat.default, (halves, -1), before=node)
        product = edit.insert(aten.view_as_complex.default, (pair,), before=node)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        done += 1
    return done


def _split_sums_over_cats(graph: fx.Graph) -> int:
    """sum(f(cat(parts, d)), [d]) -> sum(f(part_0), [d]) + sum(f(part_1), [d]) + ... (module doc), f pointwise with
    its other operands of size 1 along d; how many sums were split."""
    edit = GraphEditor(graph)
    count = 0
    for node in list(graph.nodes):
        if node.target is not aten.sum.dim_IntList or len(node.args) < 2 or len(node.args[1] or ()) != 1:
            continue
        x = node.args[0]
        d = node.args[1][0] % val(x).dim()
        parts = _cat_parts(x, d, edit, before=node, depth=0)
        if parts is None:
            continue
        total = None
        for part in parts:
            one = edit.insert(aten.sum.dim_IntList, (part, *node.args[1:]), dict(node.kwargs), before=node)
            total = one if total is None else edit.insert(aten.add.Tensor, (total, one), before=node)
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        count += 1
    return count


def _cat_parts(x: fx.Node, d: int, edit: GraphEditor, *, before: fx.Node, depth: int) -> list[fx.Node] | None:
    """x's parts along dim d where x is a concatenation along d, or a pointwise op of one (its only operand of more than
    one element along d); None otherwise. A pointwise op's parts are new nodes: the op applied to each part."""
    if not isinstance(x, fx.Node) or x.op != "call_function" or depth > 16:
        return None
    ndim = val(x).dim()
    if x.target is aten.cat.default:
        dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
        if dim % ndim != d or len(x.args[0]) < 2:
            return None
        # slices of the concatenation, not its inputs: Inductor writes each input into its slice of the result, and an
        # input with a reader of its own besides the cat made it reuse that slice's memory while still in use
        parts, start = [], 0
        for part in x.args[0]:
            size = edit.size_arg(part, d, before=before)
            end = start + size if isinstance(start, int) and isinstance(size, int) else None
            if end is None:
                end = size if start == 0 else edit.insert(operator.add, (start, size), before=before)
            parts.append(edit.insert(aten.slice.Tensor, (x, d, start, end), before=before))
            start = end
        return parts
    t = x.target
    if not isinstance(t, torch._ops.OpOverload) or not (torch.Tag.pointwise in t.tags or t in SAME_SHAPE_OPS):
        return None
    along = []
    for a in x.all_input_nodes:
        v = val(a)
        if not isinstance(v, torch.Tensor):
            return None
        i = d - (ndim - v.dim())  # a's dim broadcast to d (broadcasting aligns trailing dims)
        if i >= 0 and not (isinstance(v.shape[i], int) and v.shape[i] == 1):
            along.append(a)
    if len(along) != 1 or val(along[0]).dim() != ndim or any(isinstance(v, fx.Node) for v in x.kwargs.values()):
        return None
    parts = _cat_parts(along[0], d, edit, before=before, depth=depth + 1)
    if parts is None:
        return None
    carrier = along[0]
    return [
        edit.insert(t, tuple(part if a is carrier else a for a in x.args), dict(x.kwargs), before=before)
        for part in parts
    ]


def _gate_products(graph: fx.Graph) -> int:
    """mm(silu(gate) * up, b) on CUDA, gate and up the halves of one tensor gu of b's dtype, becomes
    tpweave::invariant_gated_mm(gu, b) (module doc); how many did. On the CPU Inductor's kernel stays: row-wise, and
    one kernel at every M."""
    edit = GraphEditor(graph)
    done = 0
    for mm in list(graph.nodes):
        if mm.target is not aten.mm.default:
            continue
        x, b = mm.args[:2]
        gu = gated_input(x, val(b).shape[0])
        if gu is None or not (val(gu).is_cuda and val(gu).dtype == val(x).dtype == val(b).dtype):
            continue
        node = edit.insert(tpw.invariant_gated_mm.default, (gu, b), before=mm)
        mm.replace_all_uses_with(node)
        graph.erase_node(mm)
        edit.erase_unused(between(gu, x))
        done += 1
    return done


ROW_PARALLEL_FUSIONS = {
    tpw.all_reduce.default: tpw.tp_invariant_mm_all_reduce.default,  # (x, group_name, world_size, policy)
    tpw.reduce_scatter_tokens.default: tpw.tp_invariant_mm_reduce_scatter.default,  # (x, 1, group_name, world_size)
}


def row_parallel_product(x: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """x as a matmul's product: (the mm, the reshapes from the mm to x, x last) when x is mm(a, b) or reshapes of its
    rows (its last dim kept, as a Hugging Face linear's (B, S, N) view), each node read by the next alone; None when it
    is not (or when x's sizes are computed from the chain itself)."""
    chain = []
    node = x
    while isinstance(node, fx.Node) and node.target in VIEW_OPS and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is aten.mm.default):
        return None
    if sum(u.target is not aten.sym_size.int for u in node.users) != 1:  # its sizes' reads: read_sizes_elsewhere
        return None
    if chain:
        sizes = chain[0].args[1]
        if not same(val(x).shape[-1], val(node).shape[-1]) or any(s in chain or s is node for s in sizes):
            return None
    return node, chain[::-1]


def read_sizes_elsewhere(edit: GraphEditor, product: fx.Node) -> None:
    """The sizes read off mm(a, b) (aten.sym_size, read by a later view or by nothing: the SP pass's dynamic graphs
    leave unread ones) read off a and b instead, so that the product itself can go: its rows are a's, its columns
    b's."""
    a, b = product.args[:2]
    for user in [u for u in product.users if u.target is aten.sym_size.int]:
        if user.users:
            dim = user.args[1] % 2
            user.replace_all_uses_with(edit.size_arg(a if dim == 0 else b, dim, before=user))
        edit.graph.erase_node(user)


def _fuse_row_parallel(graph: fx.Graph) -> dict[str, int]:
    """level "tp": mm(a, b) read only by an all-reduce or a reduce-scatter over tokens (through reshapes of its rows)
    becomes one op that sums the ranks' K-chunk subtrees in the TP=1 product's tree. {what was fused: count}.

        y = mm(a, b)                                    r = tp_invariant_mm_all_reduce(a, b, g, W)
        x = reshape(y, [B, S, N])              ->       r = reshape(r, [B, S, N])
        r = tpweave.all_reduce(x, g, W, p)
    """
    edit = GraphEditor(graph)
    fused: dict[str, int] = {}
    for user in list(graph.nodes):
        if user.target not in ROW_PARALLEL_FUSIONS:
            continue
        x = user.args[0]
        found = row_parallel_product(x)
        if found is None:
            continue
        product, chain = found
        if user.target is tpw.all_reduce.default:
            group_name, world_size = user.args[1], user.args[2]
        elif user.args[1] == val(x).dim() - 1:  # every dim but the last a token dim: the product's rows
            group_name, world_size = user.args[2], user.args[3]
        else:
            continue
        read_sizes_elsewhere(edit, product)
        name = f"mm + {user.target}"
        one = edit.insert(ROW_PARALLEL_FUSIONS[user.target], (*product.args[:2], group_name, world_size), before=user)
        if chain and user.target is tpw.all_reduce.default:
            one = edit.insert(aten.reshape.default, (one, chain[-1].args[1]), before=user)
        user.replace_all_uses_with(one)
        graph.erase_node(user)
        edit.erase_unused({product, *chain})
        fused[name] = fused.get(name, 0) + 1
    return fused


PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


def _unfused_product_sums(graph: fx.Graph) -> list[fx.Node]:
    """level "tp": the sums over ranks left whose input is a matmul's product (through reshapes, casts and copies):
    their ranks' parts were each rounded alone, so the sum is not the TP=1 product's. A sum of something else (a
    vocab-parallel embedding's rows, one rank's nonzero) is left to the batch level's ordered sum."""
    sums = []
    for node in graph.nodes:
        if node.target in ROW_PARALLEL_FUSIONS or node.target is tpw.ordered_reduce_scatter_tokens.default:
            x = node.args[0]
        elif node.target is tpw.ordered_sum_gathered.default and _arg(node, 2, "dtype") is None:
            x = node.args[0].args[0].args[0]  # ordered_sum_gathered(wait_tensor(all_gather_into_tensor(x, ...)))
        else:
            continue
        while isinstance(x, fx.Node) and (x.target in VIEW_OPS or x.target in SAME_SHAPE_OPS):
            x = x.args[0]
        if isinstance(x, fx.Node) and (x.target in PRODUCTS or _grouped_mm_args(x)):
            sums.append(node)
    return sums


# namespaces of ops whose semantics the pass knows: torch's own (the ones that reduce across rows are NOT_INVARIANT or
# swapped), tpweave's, and torch's functional collectives (the summing ones are _unordered_collective)
KNOWN_NAMESPACES = {"aten", "prims", "tpweave", "_c10d_functional", "c10d", "profiler"}


def _foreign_op(node: fx.Node) -> str | None:
    """The name of the op a node runs when the pass cannot know what it does across rows: a custom op of another
    library (e.g. transformers' grouped_mm_fallback, a mixture of experts' per-expert matmuls at M = the tokens routed
    to the expert), directly or under auto_functionalized, or a higher-order op it does not know; None otherwise."""
    target = node.target
    if target in AUTO_FUNCTIONALIZED and node.args:
        target = node.args[0]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return str(target.name())
    if isinstance(target, torch._ops.OpOverload) and target.namespace not in KNOWN_NAMESPACES:
        return str(target)
    return None


# a grouped matmul as a mixture of experts runs its experts, (a (S, K), b (G, K, N), offs (G,)): torch's, and
# transformers' own CPU fallback (a custom op, matched by name: transformers need not be importable here)
GROUPED_MM_FALLBACKS = {"transformers.grouped_mm_fallback.default"}


def _grouped_mm_args(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(a, b, offs) of a grouped matmul that tpweave::invariant_grouped_mm computes; None for anything else."""
    if node.op != "call_function":
        return None
    if node.target is aten._grouped_mm.default:
        a, b = node.args[:2]
        offs, bias, out_dtype = (_arg(node, i, name) for i, name in ((2, "offs"), (3, "bias"), (4, "out_dtype")))
        if offs is None or bias is not None or val(a).dim() != 2 or val(b).dim() != 3:
            return None
        if out_dtype is not None and out_dtype != val(a).dtype:
            return None
        return a, b, offs
    if str(node.target) in GROUPED_MM_FALLBACKS:
        return _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "offs")
    return None


def _arg(node: fx.Node, i: int, name: str):
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _unordered_collective(node: fx.Node, level: str) -> bool:
    """A collective that sums across ranks in an order of the backend's (its size decides where each row's sum
    starts), or a strategy-dispatched op whose policy is not the level's ordered strategy (ops/strategies/ordered.py:
    at level "tp" its matmuls are tree products)."""
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
        return policy != BY_LEVEL[level]
    return "num_sms" in names  # the token split's side-stream all-reduce + norm: no policy, never ordered
