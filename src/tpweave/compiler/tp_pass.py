"""The pass tpweave runs on each graph (Inductor's post-grad custom pre-pass: the whole ATen graph,
before Inductor's own passes and before any graph partition), and the torch.compile backend that
installs it.

SP variant:    sequence_parallel -> async_tp (all-gather + matmul, matmul + reduce-scatter) ->
               reduce-scatter + residual add + RMSNorm fusion
plain variant: all-reduce + residual add + RMSNorm fusion -> remaining all-reduces routed to their strategy
               -> linear layers through the decode GEMV
split variant: token_split (the plain graph as two token subsets, their all-reduces interleaved; invariant mode:
               all-gathers summed in rank order, at level "tp" of the products' fp32 subtrees) -> decode GEMV
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from tpweave.compiler import (
    allreduce,
    allreduce_norm,
    async_tp,
    decode_gemv,
    invariant,
    sequence_parallel,
    token_split,
)
from tpweave.compiler.graph_utils import count_collectives, dispatched_ops, funcol
from tpweave.compiler.options import CompilePlan, PassOptions
from tpweave.compiler.piecewise import PiecewiseGraphs
from tpweave.compiler.report import CompileReport, GraphReport
from tpweave.compiler.tp_group import TPGroup
from tpweave.log import logger
from tpweave.ops import gemv


class PassFailure(RuntimeError):
    """tpweave's passes failed on a graph of a module compiled with strict=True."""


class TPWeavePass(CustomGraphPass):
    """The post-grad pass object; uuid() covers our sources and options so Inductor caches stay correct."""

    def __init__(self, tp: TPGroup, options: PassOptions, report: GraphReport, *, strict: bool = False):
        self.tp, self.options, self.report, self.strict = tp, options, report, strict
        self.error: Exception | None = None

    def __call__(self, graph: fx.Graph) -> None:
        """Run the SP (+ async-TP) passes or the plain-TP ones, as the options say, on the post-grad graph in
        place; an exception is kept in `error` and raised again."""
        try:
            self._run(graph)
        except Exception as e:
            self.error = e  # Inductor wraps what we raise; keep the original for the report
            raise

    def _run(self, graph: fx.Graph) -> None:
        policy_for, report, variant = self.options.policy, self.report, self.report.variant
        report.counts_before = count_collectives(graph)
        logger.debug("[%s] graph before passes:\n%s", variant, graph)
        if self.options.sp:
            sequence_parallel.SequenceParallelPass(graph, self.tp, report).run()
            logger.debug("[%s] graph after sequence_parallel:\n%s", variant, graph)
            if self.options.async_tp:
                async_tp.fuse_all_gather_matmuls(graph, policy_for=policy_for, report=report)
                async_tp.fuse_matmul_reduce_scatters(graph, policy_for=policy_for, report=report)
                if self.options.invariant is None:  # its norm is another kernel than the plain graph's
                    allreduce_norm.fuse_reduce_scatter_norms(graph, report=report)
                logger.debug("[%s] graph after async_tp:\n%s", variant, graph)
        elif self.options.token_split:
            split = token_split.TokenSplitPass(graph, self.tp, report)
            if split.run() and self.options.token_split_sms:
                labels = allreduce_norm.fuse_split_all_reduce_norms(
                    graph, self.tp, subset=split.subset, num_sms=self.options.token_split_sms, report=report
                )
                report.schedule = token_split.schedule(graph, {**split.subset, **labels})
            if self.options.invariant is not None:
                replaced = allreduce.order_all_reduces(graph, self.tp, report=report, level=self.options.invariant)
                # the schedule again, each all-gather in its all-reduce's place (a start), its wait in the old one's,
                # a product's subtree (level "tp") in its matmul's
                subset = dict(split.subset)
                subset.update({n: subset[old] for n, old in replaced.items() if old in subset})
                kinds = {n: "all_reduce" if n.target is funcol.all_gather_into_tensor.default else "mm"
                         for n in replaced if n.target is not funcol.wait_tensor.default}  # fmt: skip
                report.schedule = token_split.schedule(graph, subset, kinds)
            logger.debug("[%s] graph after token_split:\n%s", variant, graph)
        else:
            allreduce_norm.fuse_all_reduce_norms(graph, self.tp, policy_for=policy_for, report=report)
            allreduce.route_all_reduces(graph, self.tp, policy_for=policy_for, report=report)
        if self.options.decode_gemv:
            decode_gemv.route_linears(graph, report=report, norms=self.options.norm_gemv)
        if self.options.invariant is not None:
            invariant.make_batch_invariant(graph, report=report, strict=self.strict, level=self.options.invariant)
        graph.lint()
        report.counts_after = count_collectives(graph)
        report.dispatched = dispatched_ops(graph)

    def uuid(self) -> bytes:
        """A hash of the passes' sources and of this pass's options (Inductor's cache key)."""
        h = hashlib.sha256()
        for mod in (sequence_parallel, async_tp, allreduce, allreduce_norm, token_split, decode_gemv, gemv, invariant):
            h.update(inspect.getsource(mod).encode())
        h.update(repr((dataclasses.asdict(self.tp), dataclasses.asdict(self.options))).encode())
        return h.digest()


class TPBackend:
    """A torch.compile backend: Inductor plus our pass. If our pass or Inductor fails: Inductor without
    our pass; last, the graph uncompiled. Each fallback is a warning and a note in the report: a model
    never crashes for our sake, unless `strict` (then a failure of our pass raises) or in invariant mode
    (the graph would run without the invariant kernels: NotInvariant, and the compiled module refuses calls)."""

    def __init__(self, *, variant: str, tp: TPGroup, plan: CompilePlan, report: CompileReport):
        self.variant, self.tp, self.options, self.strict = variant, tp, plan.variants[variant], plan.strict
        self.report, self.inductor_config = report, plan.inductor_config
        self.piecewise_graphs = plan.piecewise_graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Compile one graph Dynamo traced (see the class doc)."""
        self.report.num_compiles += 1
        graph_report = GraphReport(self.variant)
        self.report.graphs.append(graph_report)
        tp_pass = TPWeavePass(self.tp, self.options, graph_report, strict=self.strict)
        try:
            return self._compile(gm, example_inputs, tp_pass)
        except torch._dynamo.exc.RestartAnalysis:
            # Dynamo traces the frame again and calls the backend anew (e.g. a Python float that automatic dynamic
            # made an input, specialized after all): not a failure, and this graph is not compiled
            self.report.graphs.remove(graph_report)
            self.report.num_compiles -= 1
            raise
        except Exception as e:  # any failure: fall back, never crash
            if tp_pass.error is not None:
                if self.strict:
                    raise PassFailure(f"[{self.variant}] tpweave's passes failed: {describe(tp_pass.error)}") from e
                what, fallback = f"passes failed ({describe(tp_pass.error)})", "compiled without them"
            else:
                what, fallback = f"Inductor failed ({describe(e)})", "compiling without our passes"
            if self.options.invariant is not None:
                # without the passes the graph has none of the invariant kernels: refused (compiled.py), never run
                self._note(graph_report, f"{what}; refused: without tpweave's passes it would not be invariant")
                raise invariant.NotInvariant(
                    f"[{self.variant}] a graph could not be compiled with tpweave's passes ({what}); without them it "
                    "would not be invariant"
                ) from e
            self._note(graph_report, f"{what}; {fallback}")
        graph_report.sites.clear()
        graph_report.linears = graph_report.gated_linears = graph_report.norm_linears = 0
        graph_report.counts_after = dict(graph_report.counts_before)  # the graph keeps its own collectives
        try:
            return self._compile(gm, example_inputs, None)
        except Exception as e:
            self._note(
                graph_report, f"Inductor failed without our passes too ({describe(e)}); running this graph uncompiled"
            )
            return gm.forward

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list, tp_pass: TPWeavePass | None) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        patches = dict(self.inductor_config)
        decompositions = None
        if tp_pass is not None:
            # The report is written by the pass: a cache hit would skip it, so compile for real.
            patches |= {"post_grad_custom_pre_pass": tp_pass, "fx_graph_cache": False}
            if self.options.invariant is not None:
                decompositions = invariant.decompositions()  # every matmul reaches the invariant pass as one
        with torch._functorch.config.patch(enable_autograd_cache=False), _partition_wrapper(self.piecewise_graphs):
            return compile_fx(gm, example_inputs, config_patches=patches, decompositions=decompositions)

    def _note(self, graph_report: GraphReport, msg: str) -> None:
        logger.warning("[%s] %s", self.variant, msg)
        graph_report.notes.append(msg)


@contextlib.contextmanager
def _partition_wrapper(graphs: PiecewiseGraphs | None):
    """While compiling: Inductor calls every graph partition through `graphs` (none: as it was). torch keeps the
    wrapper process-wide and applies it when a compiled graph is loaded, within compile_fx."""
    if graphs is None:
        yield
        return
    from torch._inductor import utils

    holder = getattr(utils, "_unstable_customized_partition_wrapper", None)
    if holder is None or not hasattr(utils, "set_customized_partition_wrappers"):
        raise RuntimeError(
            f"piecewise_graphs needs Inductor's partition wrappers (torch >= 2.9), not in torch {torch.__version__}"
        )
    before = holder.wrapper
    utils.set_customized_partition_wrappers(graphs.wrap)
    try:
        yield
    finally:
        utils.set_customized_partition_wrappers(before)


def describe(e: BaseException) -> str:
    """'TypeName: first line of the message'."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
