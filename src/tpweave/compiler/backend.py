"""`tpweave.compile`: torch.compile with our graph passes; per variant one graph serves every M >= 2.

Variants: "sp" (sequence parallel + async TP, used for M >= sp_min_tokens) and "plain" (the model's own
all-reduces). Both are compiled with M dynamic. The passes run as Inductor's post-grad custom pre-pass,
on the whole graph, before Inductor's own passes and before any graph partition.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from tpweave.compiler import allreduce, allreduce_norm, async_tp, sequence_parallel
from tpweave.compiler.dynamic import mark_tokens_dynamic, token_dynamic_config
from tpweave.compiler.graph_utils import count_collectives
from tpweave.compiler.log import logger
from tpweave.compiler.report import CompileReport, GraphReport
from tpweave.compiler.sequence_parallel import SPConfig
from tpweave.ops.overlap import chosen_name, without_unsafe_under_cudagraph_trees
from tpweave.runtime.agreement import check_ranks_agree

if TYPE_CHECKING:
    from tpweave.tuning.table import StrategyTable

# Without a calibration table: SP from M >= 2048 with torch's fused ops there (CUDA; sequential
# elsewhere). On 2x H200, TP=2, that arm was 1.03-1.07x (llama3-8b) and 1.04-1.05x (llama3-70b) the
# plain graph at M = 2048..8192 and 0.88-0.94x at 512-1024, while SP with sequential collectives lost
# at every M (0.81-0.98x): benchmarks/results/2026-11-30-layer-llama3-*-tp2.md, sp_fused / sp_seq arms.
DEFAULT_SP_MIN_TOKENS = 2048
DEFAULT_OVERLAP_POLICY = "sequential@0,symm_mem_fused@2048"
ATTENTION_OPS = ("tpweave::attention", "tpweave::paged_attention")
# On NCCL groups the plain graph fuses each all-reduce with the residual add + RMSNorm after it
# (ops/strategies/triton_ar_norm.py): on 2x H200 it beat NCCL + a separate add + norm kernel at every
# M from 1 to 8192 (calibration, all_reduce_rms_norm site) and made two llama3-8b layers 1.07-1.14x
# faster at M = 1..256 (benchmarks/probes/decode_layer_kernels.py).
DEFAULT_AR_NORM_POLICY = "triton_ar_norm"
# The arm every comparison is against: plain TP, NCCL all-reduce, Inductor's own add + norm.
BASELINE = MappingProxyType(
    {"sp": False, "table": None, "all_reduce_policy": "sequential", "all_reduce_rms_norm_policy": "sequential"}
)


@dataclass(frozen=True)
class PassOptions:
    sp: bool
    async_tp: bool
    ag_mm_policy: str = "sequential"  # default for sites the table does not list
    mm_rs_policy: str = "sequential"
    all_reduce_policy: str = "sequential"
    all_reduce_rms_norm_policy: str = "sequential"  # "sequential": not fused (Inductor's add + norm)
    site_policies: tuple[tuple[str, str], ...] = ()  # ("ag_mm:4096x3072", policy), from the table
    cudagraph_trees: bool = False  # compiled with Inductor's CUDA graphs (cudagraphs=True)

    def policy(self, kind: str, k: int, n: int) -> str:
        # FP8 sites stay sequential unless a calibration table lists a measured strategy for them
        defaults = {
            "ag_mm": self.ag_mm_policy,
            "mm_rs": self.mm_rs_policy,
            "all_reduce": self.all_reduce_policy,
            "all_reduce_rms_norm": self.all_reduce_rms_norm_policy,
        }
        default = defaults.get(kind, "sequential")
        return self.policy_string(dict(self.site_policies).get(f"{kind}:{k}x{n}", default))

    def policy_string(self, policy: str) -> str:
        return without_unsafe_under_cudagraph_trees(policy) if self.cudagraph_trees else policy


class TPWeavePass(CustomGraphPass):
    """The post-grad pass object; uuid() covers our sources and options so Inductor caches stay correct."""

    def __init__(self, sp_cfg: SPConfig, options: PassOptions, report: GraphReport):
        self.sp_cfg, self.options, self.report = sp_cfg, options, report
        self.error: Exception | None = None

    def __call__(self, graph: fx.Graph) -> None:
        try:
            self._run(graph)
        except Exception as e:
            self.error = e  # Inductor wraps what we raise; keep the original for the report
            raise

    def _run(self, graph: fx.Graph) -> None:
        self.report.counts_before = count_collectives(graph)
        logger.debug("[%s] graph before passes:\n%s", self.report.variant, graph)
        if self.options.sp:
            sequence_parallel.SequenceParallelPass(graph, self.sp_cfg, self.report).run()
            logger.debug("[%s] graph after sequence_parallel:\n%s", self.report.variant, graph)
            if self.options.async_tp:
                async_tp.fuse_all_gather_scaled_matmuls(graph, policy_for=self.options.policy, report=self.report)
                async_tp.fuse_all_gather_matmuls(graph, policy_for=self.options.policy, report=self.report)
                async_tp.fuse_matmul_reduce_scatters(graph, policy_for=self.options.policy, report=self.report)
                allreduce_norm.fuse_reduce_scatter_norms(graph, report=self.report)
                logger.debug("[%s] graph after async_tp:\n%s", self.report.variant, graph)
        else:
            allreduce_norm.fuse_all_reduce_norms(graph, self.sp_cfg, policy_for=self.options.policy, report=self.report)
            allreduce.route_all_reduces(graph, self.sp_cfg, policy_for=self.options.policy, report=self.report)
        graph.lint()
        self.report.counts_after = count_collectives(graph)

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        for mod in (sequence_parallel, async_tp, allreduce, allreduce_norm):
            h.update(inspect.getsource(mod).encode())
        h.update(repr((asdict(self.sp_cfg), asdict(self.options))).encode())
        return h.digest()


class TPBackend:
    """A torch.compile backend: Inductor plus our pass; on a pass failure, Inductor without it."""

    def __init__(
        self, *, variant: str, sp_cfg: SPConfig, options: PassOptions, report: CompileReport, inductor_options: dict
    ):
        self.variant, self.sp_cfg, self.options = variant, sp_cfg, options
        self.report, self.inductor_options = report, inductor_options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Inductor + our passes. If our pass or Inductor fails: Inductor without our passes; last, the
        graph uncompiled. Each fallback is a warning and a note in the report: a model never crashes
        for our sake."""
        self.report.num_compiles += 1
        graph_report = GraphReport(self.variant)
        self.report.graphs.append(graph_report)
        tp_pass = TPWeavePass(self.sp_cfg, self.options, graph_report)
        try:
            return self._compile(gm, example_inputs, tp_pass)
        except Exception as e:  # noqa: BLE001  (any failure: fall back, never crash)
            if tp_pass.error is not None:
                self._note(graph_report, f"passes failed ({_describe(tp_pass.error)}); compiled without them")
            else:
                self._note(graph_report, f"Inductor failed ({_describe(e)}); compiling without our passes")
        graph_report.sites.clear()
        graph_report.counts_after = dict(graph_report.counts_before)  # the graph keeps its own collectives
        try:
            return self._compile(gm, example_inputs, None)
        except Exception as e:  # noqa: BLE001
            self._note(
                graph_report, f"Inductor failed without our passes too ({_describe(e)}); running this graph uncompiled"
            )
            return gm.forward

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list, tp_pass: TPWeavePass | None) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        patches = dict(self.inductor_options)
        if tp_pass is not None:
            # The report is written by the pass: a cache hit would skip it, so compile for real.
            patches |= {"post_grad_custom_pre_pass": tp_pass, "fx_graph_cache": False}
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)

    def _note(self, graph_report: GraphReport, msg: str) -> None:
        logger.warning("[%s] %s", self.variant, msg)
        graph_report.notes.append(msg)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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
    variants: dict[str, Callable]
    sp_min_tokens: int
    compile_report: CompileReport
    num_tokens_fn: Callable[[tuple], int]
    options: dict[str, PassOptions] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=lambda: {"sp": 0, "plain": 0})

    def variant_for(self, num_tokens: int) -> str:
        return "sp" if "sp" in self.variants and num_tokens >= self.sp_min_tokens else "plain"

    def strategies_at(self, num_tokens: int) -> set[str]:
        """Strategy names the sites of the graph serving M = num_tokens may run (from the policies)."""
        opts = self.options[self.variant_for(num_tokens)]
        kinds = (
            ("ag_mm", "mm_rs", "ag_scaled_mm", "scaled_mm_rs")
            if opts.sp and opts.async_tp
            else ()
            if opts.sp
            else ("all_reduce", "all_reduce_rms_norm")
        )
        if not opts.sp:  # only the kinds the plain graph really has (every all-reduce may have been fused)
            done = {(s.kind, s.action) for g in self.compile_report.graphs if g.variant == "plain" for s in g.sites}
            kinds = tuple(
                k for k, action in (("all_reduce", "routed"), ("all_reduce_rms_norm", "fused")) if (k, action) in done
            )
        policies = [opts.policy(k, -1, -1) for k in kinds]  # the defaults (no site has shape -1)
        policies += [p for site, p in opts.site_policies if site.split(":")[0] in kinds]
        return {chosen_name(opts.policy_string(policy), num_tokens) for policy in policies}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # keyword arguments (HF style: model(input_ids=..., attention_mask=...)) after the positional ones
        inputs = args + tuple(kwargs.values())
        num_tokens = self.num_tokens_fn(inputs)
        if num_tokens < 1:
            raise ValueError(f"empty batch: {num_tokens} tokens")
        variant = self.variant_for(num_tokens)
        self.calls[variant] += 1
        _mark_dynamic(inputs)
        num_compiles_before = self.compile_report.num_compiles
        with _dynamo_budget(len(self.variants)) as watch:
            try:
                out = self.variants[variant](*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                # Dynamo could not trace the forward (e.g. torch 2.13's DTensor sharding propagation under
                # dynamic shapes): the same on every rank, so every rank runs the module eagerly from now on
                self._note(
                    f"[{variant}] torch.compile failed to trace this model ({_describe(e)}): it runs eagerly, "
                    "without tpweave's passes"
                )
                self.variants[variant] = self.module
                out = self.module(*args, **kwargs)
        compiled_now = self.compile_report.num_compiles - num_compiles_before
        for function in watch.functions:
            self._note(
                f"Dynamo reached its recompile limit (torch._dynamo.config.recompile_limit x {len(self.variants)} "
                "tpweave "
                f"graph variants) in {function}: inputs needing a new graph there run eagerly, without tpweave's "
                "passes (raise the limit; TORCH_LOGS=recompiles says what each graph specialized on)"
            )
            if function not in self.compile_report.recompile_limit_hit_in:
                self.compile_report.recompile_limit_hit_in.append(function)
        if self.calls[variant] == 1 and self.variants[variant] is not self.module:
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


def compile(
    module: torch.nn.Module,
    *,
    group: dist.ProcessGroup | str | None = None,
    sp: bool | None = None,
    async_tp: bool = True,
    sp_min_tokens: int | None = None,
    table: StrategyTable | str | None = "auto",
    ag_mm_policy: str = DEFAULT_OVERLAP_POLICY,
    mm_rs_policy: str = DEFAULT_OVERLAP_POLICY,
    all_reduce_policy: str = "sequential",
    all_reduce_rms_norm_policy: str | None = None,
    cudagraphs: bool = False,
    piecewise: bool = False,
    num_tokens_fn: Callable[[tuple], int] | None = None,
) -> CompiledTP:
    """Compile a TP module with sequence parallelism and async TP. See docs/user_guide.md."""
    if not dist.is_initialized():
        raise ValueError("tpweave.compile needs an initialized process group (tpweave.launch or init_distributed)")
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    group = group or dist.group.WORLD
    sp_cfg = SPConfig(group_name=group.group_name, rank=dist.get_rank(group), world_size=dist.get_world_size(group))
    if isinstance(table, str):
        if table != "auto":
            raise ValueError(f"table must be a StrategyTable, None or 'auto', got {table!r}")
        table = _cached_table(module, sp_cfg.world_size)
    if sp_min_tokens is None and table is not None:
        sp_min_tokens = table.sp_min_tokens
    if sp_min_tokens is None:
        # The boundary is a GPU measurement; off the GPU (gloo) there is nothing to win or lose, so
        # the SP graph serves every M there and CPU runs exercise it.
        sp_min_tokens = DEFAULT_SP_MIN_TOKENS if dist.get_backend(group) == "nccl" else 0
        logger.info(
            "no calibration table: sequence parallel from M >= %d (tpweave calibrate would tune this)", sp_min_tokens
        )
    site_policies = tuple(sorted(table.policies.items())) if table is not None else ()
    if all_reduce_rms_norm_policy is None:  # the default where no table lists the site
        all_reduce_rms_norm_policy = DEFAULT_AR_NORM_POLICY if dist.get_backend(group) == "nccl" else "sequential"
    if sp_min_tokens < 0:
        raise ValueError(f"sp_min_tokens must be >= 0, got {sp_min_tokens}")
    inductor_options: dict[str, Any] = {}
    if cudagraphs:
        inductor_options["triton.cudagraphs"] = True
    if piecewise:
        inductor_options["graph_partition"] = True
        inductor_options["custom_should_partition_ops"] = list(ATTENTION_OPS)
    if sp is None:
        sp = sp_cfg.world_size > 1  # with one rank SP only adds copies; sp=True still forces it (tests)
    # Ranks that compiled different graphs or strategies would wait on each other's collectives forever
    # (e.g. a calibration table found, or found corrupt, on some ranks only): refuse up front.
    check_ranks_agree(
        {
            "sp": sp,
            "async_tp": async_tp,
            "sp_min_tokens": sp_min_tokens,
            "ag_mm_policy": ag_mm_policy,
            "mm_rs_policy": mm_rs_policy,
            "all_reduce_policy": all_reduce_policy,
            "all_reduce_rms_norm_policy": all_reduce_rms_norm_policy,
            "table_policies": list(site_policies),
            "cudagraphs": cudagraphs,
            "piecewise": piecewise,
        },
        group=group,
        what="tpweave.compile options (a calibration table present, or valid, on some ranks only?)",
    )
    report = CompileReport(sp_min_tokens=sp_min_tokens if sp else None)
    variants: dict[str, Callable] = {}
    want = {
        "plain": PassOptions(
            sp=False,
            async_tp=False,
            all_reduce_policy=all_reduce_policy,
            all_reduce_rms_norm_policy=all_reduce_rms_norm_policy,
            site_policies=site_policies,
            cudagraph_trees=cudagraphs,
        )
    }
    if sp:
        want["sp"] = PassOptions(
            sp=True,
            async_tp=async_tp,
            ag_mm_policy=ag_mm_policy,
            mm_rs_policy=mm_rs_policy,
            site_policies=site_policies,
            cudagraph_trees=cudagraphs,
        )
    for name, options in want.items():
        backend = TPBackend(
            variant=name, sp_cfg=sp_cfg, options=options, report=report, inductor_options=inductor_options
        )
        variants[name] = torch.compile(module, backend=backend, dynamic=None)
    return CompiledTP(module, variants, sp_min_tokens, report, num_tokens_fn or default_num_tokens, options=want)


def _cached_table(module: torch.nn.Module, world_size: int) -> StrategyTable | None:
    """The calibration table for a tpweave model (one with a ModelConfig), if one was measured."""
    from tpweave.models.config import ModelConfig
    from tpweave.tuning.table import load_table, table_key

    cfg = getattr(module, "config", None)
    param = next(module.parameters(), None)
    if not isinstance(cfg, ModelConfig) or param is None or world_size == 1:
        return None
    return load_table(table_key(cfg, tp=world_size, dtype=param.dtype))


def report(compiled: CompiledTP) -> CompileReport:
    if not isinstance(compiled, CompiledTP):
        raise ValueError(f"tpweave.report expects what tpweave.compile returned, got {type(compiled).__name__}")
    return compiled.compile_report
