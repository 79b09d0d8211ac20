"""CompiledTP: what `tpweave.compile` returns. A callable with the module's signature that sends each
call to the graph variant for its token count M ("sp" from the plan's sp_min_tokens on, "plain"
below), marks the token dims dynamic, and notes in the report what Dynamo did that the passes
cannot see (no graph traced, graph breaks, a reached recompile limit)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpweave.compiler.dynamic import mark_tokens_dynamic, token_dynamic_config
from tpweave.compiler.invariant import NotInvariant
from tpweave.compiler.options import CompilePlan
from tpweave.compiler.report import CompileReport
from tpweave.compiler.tp_pass import PassFailure, describe
from tpweave.log import logger, progress
from tpweave.ops.strategies import chosen_name

TOKEN_KWARGS = ("input_ids", "inputs_embeds")  # HF's names of the token inputs


def default_num_tokens(args: tuple) -> int:
    """M: elements of the first integer tensor argument (token ids), else rows of the first tensor.
    `args`: the positional arguments, then the keyword arguments' values in the order given."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point() and t.dim() >= 1:
            return t.numel()
    if tensors and tensors[0].dim() >= 2:
        return tensors[0].numel() // tensors[0].shape[-1]
    raise ValueError("cannot tell the number of tokens from the arguments: pass num_tokens_fn=")


class _RecompileLimitWatch(logging.Filter):
    """Dynamo says it reached a recompile limit only in a log warning, then runs that code eagerly."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        super().__init__()
        self.functions: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "hit config." in record.msg:
            lines = record.getMessage().splitlines()
            self.functions += [line.split("function:", 1)[1].strip() for line in lines if "function:" in line] or ["?"]
        return True


@contextlib.contextmanager
def _dynamo_budget(num_variants: int):
    """Dynamo's recompile limit counts the cache entries of one code object: tpweave's variants of a
    module (and every module of the same class in the process) share it, so each variant gets the
    user's limit times the number of variants. Yields the watch that sees a limit reached."""
    watch = _RecompileLimitWatch()
    logger_ = logging.getLogger(_RecompileLimitWatch.LOGGER)
    limit = torch._dynamo.config.recompile_limit * num_variants
    logger_.addFilter(watch)
    try:
        with token_dynamic_config(), torch._dynamo.config.patch(recompile_limit=limit):
            yield watch
    finally:
        logger_.removeFilter(watch)


def _mark_dynamic(args: tuple) -> None:
    """Token-like dims: every dim of integer tensors, every dim but the last (hidden) of float tensors."""
    for a in args:
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            continue
        ndim = a.dim() if not a.is_floating_point() else max(a.dim() - 1, 1)
        for d in range(ndim):
            mark_tokens_dynamic([a], dim=d)


@dataclass
class CompiledTP:
    """Callable with the module's signature; dispatches each call to the SP or the plain graph by M."""

    module: torch.nn.Module
    variants: dict[str, Callable]  # "plain", "sp" when sequence parallelism is on, "split" with token split
    plan: CompilePlan
    compile_report: CompileReport
    num_tokens_fn: Callable[[tuple], int] = field(default=lambda args: default_num_tokens(args))
    eager: Callable | None = None  # what runs when Dynamo cannot trace: the module or its bound method
    calls: dict[str, int] = field(default_factory=lambda: {"sp": 0, "split": 0, "plain": 0})
    # (variant, M == 1) -> index in compile_report.graphs of the graph compiled when such an M first ran
    graph_of: dict[tuple[str, bool], int] = field(default_factory=dict)
    # invariant mode: why calls are refused (some inputs ran, or would run, eagerly without the invariant kernels)
    not_invariant: str | None = None

    def __post_init__(self) -> None:
        if self.eager is None:
            self.eager = self.module

    @property
    def sp_min_tokens(self) -> int:
        """The SP graph serves M >= this (when there is one)."""
        return self.plan.sp_min_tokens

    def variant_for(self, num_tokens: int) -> str:
        """ "sp", "split" or "plain": the graph variant that serves M = num_tokens (SP first)."""
        if "sp" in self.variants and num_tokens >= self.sp_min_tokens:
            return "sp"
        split = self.plan.token_split_min_tokens
        return "split" if "split" in self.variants and num_tokens >= split else "plain"

    def variant_ranges(self) -> dict[str, tuple[int, int | None]]:
        """Each graph variant's token counts M >= 2 as (lowest, highest + 1 or None): where "split" and "sp" start."""
        sp = self.sp_min_tokens if "sp" in self.variants else None
        split = self.plan.token_split_min_tokens if "split" in self.variants else None
        ranges = {"plain": (2, split or sp), "split": (split, sp), "sp": (sp, None)}
        return {v: (max(lo or 2, 2), hi) for v, (lo, hi) in ranges.items() if v in self.variants}

    def serves(self, variant: str, num_tokens: int) -> str:
        """The token counts the graph of `variant` compiled for a call of num_tokens serves, in words: M = 1 has a
        graph of its own (compiler/dynamic.py), every other M of the variant's range one graph."""
        if num_tokens == 1:
            return "M = 1"
        low, high = self.variant_ranges()[variant]
        return f"M >= {low}" if high is None else f"M = {low}..{high - 1}"

    def graph_report_for(self, num_tokens: int):
        """The GraphReport of the graph that serves M = num_tokens (after a call with such an M), else None."""
        index = self.graph_of.get((self.variant_for(num_tokens), num_tokens == 1))
        return None if index is None else self.compile_report.graphs[index]

    def strategies_at(self, num_tokens: int) -> set[str]:
        """Strategy names the sites of the graph serving M = num_tokens may run (from the policies)."""
        opts = self.plan.variants[self.variant_for(num_tokens)]
        kinds = None
        if not opts.sp:  # only the kinds the plain graph really has (every all-reduce may have been fused)
            done = {(s.kind, s.action) for g in self.compile_report.graphs if g.variant == "plain" for s in g.sites}
            kinds = tuple(
                k for k, act in (("all_reduce", "routed"), ("all_reduce_rms_norm", "fused")) if (k, act) in done
            )
        return {chosen_name(policy, num_tokens) for policy in opts.policies(kinds)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph variant for the call's M (ValueError when M < 1). Where Dynamo cannot trace the forward
        that variant runs the module eagerly from then on (unless the plan is strict and a pass failed, which
        raises), and what Dynamo did that the passes cannot see is logged and noted in the report."""
        # keyword arguments (HF style: model(input_ids=..., attention_mask=...)) after the positional ones,
        # the token ids (or embeddings) first: M is read from them
        first = [kwargs[k] for k in TOKEN_KWARGS if kwargs.get(k) is not None]
        inputs = args + tuple(first) + tuple(v for k, v in kwargs.items() if k not in TOKEN_KWARGS)
        num_tokens = self.num_tokens_fn(inputs)
        if num_tokens < 1:
            raise ValueError(f"empty batch: {num_tokens} tokens")
        variant = self.variant_for(num_tokens)
        invariant = self.plan.variants[variant].invariant
        if invariant is not None and self.not_invariant is not None:
            raise RuntimeError(self.not_invariant)
        self.calls[variant] += 1
        _mark_dynamic(inputs)
        num_compiles_before, start = self.compile_report.num_compiles, time.monotonic()
        trace_error = None
        with _dynamo_budget(len(self.variants)) as watch:
            try:
                out = self.variants[variant](*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                if self.plan.strict and _caused_by(e, PassFailure):
                    raise
                # Dynamo could not trace the forward (e.g. torch 2.13's DTensor sharding propagation under
                # dynamic shapes): the same on every rank, so every rank runs the module eagerly from now on
                refused = _cause(e, NotInvariant)  # the backend's: a graph without the passes' invariant kernels
                trace_error = str(refused) if refused is not None else describe(e)
                self._note(
                    f"[{variant}] torch.compile failed to trace this model ({trace_error}): it runs eagerly, "
                    "without tpweave's passes"
                )
                self.variants[variant] = self.eager
                out = self.eager(*args, **kwargs)
        compiled_now = self.compile_report.num_compiles - num_compiles_before
        if compiled_now:
            self.graph_of.setdefault((variant, num_tokens == 1), len(self.compile_report.graphs) - 1)
            for graph in self.compile_report.graphs[-compiled_now:]:
                graph.serves = self.serves(variant, num_tokens)
            progress(
                "compiled %d %s graph(s) for M=%d in %.1f s",
                compiled_now,
                variant,
                num_tokens,
                time.monotonic() - start,
            )
        for function in watch.functions:
            self._note(
                f"Dynamo reached its recompile limit (torch._dynamo.config.recompile_limit x {len(self.variants)} "
                "tpweave "
                f"graph variants) in {function}: inputs needing a new graph there run eagerly, without tpweave's "
                "passes (raise the limit; TORCH_LOGS=recompiles says what each graph specialized on)"
            )
            if function not in self.compile_report.recompile_limit_hit_in:
                self.compile_report.recompile_limit_hit_in.append(function)
        fell_back = [f"Dynamo reached its recompile limit in {f}" for f in watch.functions]
        advice = []
        if fell_back:
            advice.append(
                "Raise torch._dynamo.config.recompile_limit (TORCH_LOGS=recompiles says what each graph specialized "
                "on) and compile again"
            )
        if self.variants[variant] is self.eager:
            fell_back.append("torch.compile failed to trace this model" + (f" ({trace_error})" if trace_error else ""))
            advice.append("Invariant mode needs a forward Dynamo can trace")
        if invariant is not None and fell_back:
            # this call's results (and those of any later input that would need a new graph) came from the eager
            # module, without the invariant kernels: refused from now on rather than returned
            self.not_invariant = (
                f"invariant={invariant!r}: {'; '.join(fell_back)}, so inputs ran eagerly without the invariant "
                "kernels and their results would not be invariant; this compiled module refuses every call from now "
                f"on. {'. '.join(advice)}"
            )
            raise RuntimeError(self.not_invariant)
        if self.calls[variant] == 1 and self.variants[variant] is not self.eager:
            if (
                not any(g.variant == variant for g in self.compile_report.graphs)
                and not self.compile_report.recompile_limit_hit_in
            ):
                self._note(
                    f"[{variant}] torch.compile traced no graph of this model: it runs eagerly, "
                    "without tpweave's passes "
                    "(Dynamo could not trace its forward; one known cause: dist.all_reduce(..., async_op=True) and "
                    "work.wait(): use the blocking call or torch.distributed._functional_collectives)"
                )
            elif compiled_now > 1:
                self._note(
                    f"[{variant}] Dynamo split the forward into {compiled_now} graphs (graph breaks; "
                    "TORCH_LOGS=graph_breaks "
                    "says where): the passes rewrite each graph on its own, and with sequence parallelism every "
                    "boundary all-gathers the activations"
                )
        return out

    def _note(self, msg: str) -> None:
        if msg not in self.compile_report.notes:
            logger.warning(msg)
            self.compile_report.notes.append(msg)


def _caused_by(e: BaseException, kind: type) -> bool:
    """Whether `kind` is in e's chain of causes (Dynamo wraps what a backend raises)."""
    return _cause(e, kind) is not None


def _cause(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of `kind` in e's chain of causes, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or getattr(e, "inner_exception", None) or e.__context__
    return None
